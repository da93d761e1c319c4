//! healthCheckNodePort servers for `externalTrafficPolicy: Local` LoadBalancer services, as kube-proxy's:
//! the cloud load balancer probes `GET /` on the service's healthCheckNodePort of every node and sends
//! traffic only to nodes that answer 200, i.e. nodes with a ready endpoint of the service.
//!
//! The answer is JSON `{"service":{"namespace":..,"name":..},"localEndpoints":N,"serviceProxyHealthy":B}`
//! with the header `X-Load-Balancing-Endpoint-Weight: N`; 200 when N > 0 and the proxier is healthy,
//! else 503. Local endpoints are the ready endpoints whose `nodeName` is this node (kube-proxy's count:
//! distinct `ip:port` over all ports of the service).
//!
//! The servers follow the model after each successful sync (as kube-proxy updates them after each
//! successful sync). As kube-proxy's, they listen on the NodePort addresses (what `--nodeport-addresses`
//! resolves to at each full sync): one listener per port and address, or one on all addresses (dual-stack
//! `[::]`, or `0.0.0.0` without IPv6) when NodePorts are served on every local address; none when no
//! address matched. When the addresses change, every server is rebound on the new ones. A port that cannot
//! be bound is logged and retried every 5 s.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use tokio::sync::watch;

use super::health::ProxyHealth;
use super::http::{self, Handler, Request, Response};
use nftkube_model::{About, NodePortAddresses, Notice, Notices};
use nftkube_model::{ClusterState, NamespacedName, ServiceType, TrafficPolicy};

/// What one health check port reports.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct HcService {
    /// The service whose health is served.
    pub service: NamespacedName,
    /// Its ready endpoints on this node (none: the check answers 503).
    pub(crate) local_endpoints: usize,
}

/// Desired servers: healthCheckNodePort → service.
pub(crate) type HcDesired = BTreeMap<u16, HcService>;

/// What the servers should be: which ports, on which addresses.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct HcConfig {
    /// The healthCheckNodePorts to serve, by port.
    pub ports: HcDesired,
    /// The NodePort addresses (`None`, the default until the first full sync resolved them: no server).
    pub addresses: NodePortAddresses,
}

/// The health check port of a service and its local ready endpoint count; None for a service that needs
/// no health check (not a LoadBalancer with `externalTrafficPolicy: Local` and a healthCheckNodePort).
pub(crate) fn health_check_of(
    state: &ClusterState,
    name: &NamespacedName,
    node: &str,
) -> Option<(u16, usize)> {
    let port = state
        .service_ports(name)
        .iter()
        .filter(|p| {
            p.service_type == ServiceType::LoadBalancer
                && p.external_traffic_policy == TrafficPolicy::Local
        })
        .find_map(|p| p.health_check_node_port)?;
    let mut local = BTreeSet::new();
    for eps in state.service_endpoints(name).values() {
        for e in eps {
            if e.ready && !node.is_empty() && e.node_name.as_deref() == Some(node) {
                local.insert((e.ip, e.port));
            }
        }
    }
    Some((port, local.len()))
}

/// The answer of one health check server.
pub(crate) fn response(svc: &HcService, proxy_healthy: bool) -> Response {
    let body = serde_json::json!({
        "service": {"namespace": &*svc.service.namespace, "name": &*svc.service.name},
        "localEndpoints": svc.local_endpoints,
        "serviceProxyHealthy": proxy_healthy,
    });
    let ok = svc.local_endpoints > 0 && proxy_healthy;
    Response::new(
        if ok { 200 } else { 503 },
        "application/json",
        body.to_string(),
    )
    .header("X-Content-Type-Options", "nosniff")
    .header(
        "X-Load-Balancing-Endpoint-Weight",
        svc.local_endpoints.to_string(),
    )
}

struct Running {
    entry: Arc<RwLock<HcService>>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Drop for Running {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort(); // drops the listener: the port closes
        }
    }
}

/// Binds `port` on each NodePort address (on all addresses for `AllLocal`; nothing for `None`).
fn bind(addresses: &NodePortAddresses, port: u16) -> std::io::Result<Vec<tokio::net::TcpListener>> {
    let listen = |ip: IpAddr| -> std::io::Result<tokio::net::TcpListener> {
        let l = std::net::TcpListener::bind(SocketAddr::new(ip, port))?;
        l.set_nonblocking(true)?;
        tokio::net::TcpListener::from_std(l)
    };
    match addresses {
        // Dual-stack where IPv6 exists (Linux's default bindv6only=0), else IPv4 only.
        NodePortAddresses::AllLocal => match listen(IpAddr::V6(Ipv6Addr::UNSPECIFIED)) {
            Ok(l) => Ok(vec![l]),
            Err(_) => Ok(vec![listen(IpAddr::V4(Ipv4Addr::UNSPECIFIED))?]),
        },
        NodePortAddresses::Only(ips) => ips.iter().map(|ip| listen(*ip)).collect(),
        NodePortAddresses::None => Ok(Vec::new()),
    }
}

/// Drops every running server when the addresses changed (they are rebound on the new ones), and those
/// whose port is no longer wanted.
fn stop_outdated(
    running: &mut HashMap<u16, Running>,
    bound_on: &mut NodePortAddresses,
    want: &HcConfig,
) {
    if *bound_on != want.addresses {
        if !running.is_empty() {
            tracing::info!(addresses = ?want.addresses, "health check servers move to the new NodePort addresses");
        }
        running.clear();
        *bound_on = want.addresses.clone();
    }
    running.retain(|port, r| {
        let keep = want.ports.contains_key(port);
        if !keep {
            tracing::info!(port, service = %r.entry.read().map(|e| e.service.to_string()).unwrap_or_default(), "health check server stopped");
        }
        keep
    });
}

/// Keeps one server per desired port, on the desired addresses, until the sender goes away. A port that
/// cannot be bound is an Event on its Service, once until it is bound (kube-proxy's
/// `FailedToStartServiceHealthcheck`).
pub(crate) async fn run(
    mut rx: watch::Receiver<HcConfig>,
    health: Arc<ProxyHealth>,
    notices: Notices,
) {
    let mut running: HashMap<u16, Running> = HashMap::new();
    let mut reported: HashSet<u16> = HashSet::new();
    let mut bound_on = NodePortAddresses::None;
    loop {
        let desired = rx.borrow_and_update().clone();
        stop_outdated(&mut running, &mut bound_on, &desired);
        let mut failed = false;
        let serve = desired.addresses != NodePortAddresses::None;
        for (port, svc) in desired.ports.iter().filter(|_| serve) {
            if let Some(r) = running.get(port) {
                let mut e = r.entry.write().unwrap_or_else(|e| e.into_inner());
                if *e != *svc {
                    *e = svc.clone();
                }
                continue;
            }
            match bind(&desired.addresses, *port) {
                Ok(listeners) => {
                    let entry = Arc::new(RwLock::new(svc.clone()));
                    let (e, h) = (entry.clone(), health.clone());
                    let handler: Handler = Arc::new(move |_req: &Request| {
                        let svc = e.read().unwrap_or_else(|e| e.into_inner()).clone();
                        response(&svc, h.is_healthy())
                    });
                    let tasks = listeners
                        .into_iter()
                        .map(|l| {
                            tokio::spawn(http::serve(
                                l,
                                handler.clone(),
                                http::ServerKind::HealthCheck,
                            ))
                        })
                        .collect();
                    tracing::info!(port, service = %svc.service, "health check server started");
                    running.insert(*port, Running { entry, tasks });
                    reported.remove(port);
                }
                Err(e) => {
                    failed = true;
                    tracing::error!(port, service = %svc.service, "cannot start the health check server (retrying in 5 s): {e}");
                    if reported.insert(*port) {
                        notices.send(Notice {
                            about: About::Service(svc.service.clone()),
                            warning: true,
                            reason: "FailedToStartServiceHealthcheck",
                            action: "Listen",
                            note: format!(
                                "failed to start healthcheck {:?} on port {port}: {e}",
                                svc.service.to_string()
                            ),
                        });
                    }
                }
            }
        }
        if failed {
            // Retry the failed ports in 5 s, or sooner on a change.
            if let Ok(Err(_)) = tokio::time::timeout(Duration::from_secs(5), rx.changed()).await {
                return;
            }
        } else if rx.changed().await.is_err() {
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use nftkube_model::{
        Protocol, ServicePort, ServicePortName, SliceEndpoint, SliceInfo, SlicePort,
    };

    fn lb_port(name: &str, hc: Option<u16>, etp: TrafficPolicy) -> ServicePort {
        ServicePort {
            name: ServicePortName {
                service: NamespacedName::new("ns", "lb"),
                port: name.into(),
                protocol: Protocol::Tcp,
            },
            service_type: ServiceType::LoadBalancer,
            cluster_ips: vec!["10.96.0.50".parse().unwrap()],
            port: 80,
            protocol: Protocol::Tcp,
            node_port: Some(30080),
            external_ips: vec![],
            load_balancer_ips: vec!["192.0.2.10".parse().unwrap()],
            load_balancer_source_ranges: vec![],
            external_traffic_policy: etp,
            internal_traffic_policy: TrafficPolicy::Cluster,
            session_affinity_timeout: None,
            health_check_node_port: hc,
            created: nftkube_model::Created::UNKNOWN,
        }
    }

    fn ep(ip: &str, node: &str, ready: bool) -> SliceEndpoint {
        SliceEndpoint::new(ip.parse().unwrap(), ready, ready, !ready).on_node(node)
    }

    fn state(etp: TrafficPolicy, eps: Vec<SliceEndpoint>) -> ClusterState {
        let mut st = ClusterState::new();
        let key = NamespacedName::new("ns", "lb");
        let mut second = lb_port("b", Some(32000), etp);
        second.port = 81;
        st.apply_service(key, vec![lb_port("a", Some(32000), etp), second]);
        st.apply_slice(SliceInfo {
            namespace: "ns".into(),
            name: "lb-1".into(),
            service: "lb".into(),
            address_type: nftkube_model::IpFamily::V4,
            ports: vec![
                SlicePort {
                    name: "a".into(),
                    port: 8080,
                    protocol: Protocol::Tcp,
                },
                SlicePort {
                    name: "b".into(),
                    port: 8081,
                    protocol: Protocol::Tcp,
                },
            ],
            endpoints: eps,
        });
        st
    }

    #[test]
    fn local_ready_endpoints_are_counted() {
        let key = NamespacedName::new("ns", "lb");
        let st = state(
            TrafficPolicy::Local,
            vec![
                ep("10.244.1.2", "node-1", true),
                ep("10.244.1.3", "node-1", false),
                ep("10.244.2.2", "node-2", true),
            ],
        );
        // One ready local endpoint, on two ports: two distinct ip:port (kube-proxy's count).
        assert_eq!(health_check_of(&st, &key, "node-1"), Some((32000, 2)));
        assert_eq!(health_check_of(&st, &key, "node-3"), Some((32000, 0)));
        let st = state(
            TrafficPolicy::Cluster,
            vec![ep("10.244.1.2", "node-1", true)],
        );
        assert_eq!(health_check_of(&st, &key, "node-1"), None);
    }

    #[test]
    fn answers_follow_local_endpoints_and_proxy_health() {
        let svc = HcService {
            service: NamespacedName::new("ns", "lb"),
            local_endpoints: 2,
        };
        let r = response(&svc, true);
        assert_eq!(r.status, 200);
        let v: serde_json::Value = serde_json::from_str(&r.body).unwrap();
        assert_eq!(
            v,
            serde_json::json!({"service": {"namespace": "ns", "name": "lb"}, "localEndpoints": 2, "serviceProxyHealthy": true})
        );
        assert!(r
            .headers
            .contains(&("X-Load-Balancing-Endpoint-Weight", "2".into())));
        assert_eq!(response(&svc, false).status, 503);
        let none = HcService {
            local_endpoints: 0,
            ..svc
        };
        assert_eq!(response(&none, true).status, 503);
    }

    fn free_port() -> u16 {
        std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port()
    }

    /// A port something else holds: one Event on the Service, not one per retry, and none once it binds.
    #[test]
    fn a_port_that_cannot_be_bound_is_one_event_on_its_service() {
        let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = taken.local_addr().unwrap().port();
        let (tx, rx) = watch::channel(HcConfig::default());
        let (sent_tx, sent) = std::sync::mpsc::channel();
        let notices = Notices::new(move |n| sent_tx.send(n).unwrap());
        let health = Arc::new(ProxyHealth::new(Duration::from_secs(60)));
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let thread = std::thread::spawn(move || rt.block_on(run(rx, health, notices)));
        let want = |local_endpoints| HcConfig {
            ports: HcDesired::from([(
                port,
                HcService {
                    service: NamespacedName::new("ns", "lb"),
                    local_endpoints,
                },
            )]),
            addresses: NodePortAddresses::Only(vec![Ipv4Addr::LOCALHOST.into()]),
        };
        tx.send(want(1)).unwrap();
        let n = sent.recv_timeout(Duration::from_secs(5)).unwrap();
        assert_eq!(n.about, About::Service(NamespacedName::new("ns", "lb")));
        assert_eq!(
            (n.reason, n.warning),
            ("FailedToStartServiceHealthcheck", true)
        );
        assert!(n.note.contains(&format!("on port {port}")), "{}", n.note);
        // A change makes it try again at once: still failing, still one event.
        tx.send(want(2)).unwrap();
        assert!(sent.recv_timeout(Duration::from_millis(300)).is_err());
        drop(taken);
        tx.send(want(3)).unwrap();
        assert!(sent.recv_timeout(Duration::from_millis(300)).is_err());
        drop(tx);
        thread.join().unwrap();
    }

    /// The servers themselves, on 127.0.0.1 in this process: started, updated and stopped by the
    /// desired map.
    #[test]
    fn servers_follow_the_desired_map() {
        let (tx, rx) = watch::channel(HcConfig::default());
        let on = |ip: [u8; 4], ports: HcDesired| HcConfig {
            ports,
            addresses: NodePortAddresses::Only(vec![IpAddr::from(ip)]),
        };
        let health = Arc::new(ProxyHealth::new(Duration::from_secs(60)));
        let h = health.clone();
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let thread = std::thread::spawn(move || rt.block_on(run(rx, h, Notices::none())));
        let port = free_port();
        let addr = SocketAddr::from((Ipv4Addr::LOCALHOST, port));
        let key = NamespacedName::new("ns", "lb");
        let get = || http::get(addr, "/", Duration::from_secs(2));
        let wait = |want: Option<u16>| {
            let deadline = std::time::Instant::now() + Duration::from_secs(10);
            loop {
                let got = get().ok().map(|r| r.0);
                if got == want {
                    return;
                }
                assert!(
                    std::time::Instant::now() < deadline,
                    "want {want:?}, got {got:?}"
                );
                std::thread::sleep(Duration::from_millis(20));
            }
        };
        tx.send(on(
            [127, 0, 0, 1],
            HcDesired::from([(
                port,
                HcService {
                    service: key.clone(),
                    local_endpoints: 0,
                },
            )]),
        ))
        .unwrap();
        wait(Some(503));
        let one = HcDesired::from([(
            port,
            HcService {
                service: key.clone(),
                local_endpoints: 1,
            },
        )]);
        tx.send(on([127, 0, 0, 1], one.clone())).unwrap();
        wait(Some(200));
        let (_, headers, body) = get().unwrap();
        assert!(headers.contains(&("content-type".into(), "application/json".into())));
        let v: serde_json::Value = serde_json::from_str(&body).unwrap();
        assert_eq!(v["localEndpoints"], 1);
        assert_eq!(v["service"]["name"], "lb");
        // An unhealthy proxier: 503 with serviceProxyHealthy false.
        health.queued_at(
            std::time::Instant::now()
                .checked_sub(Duration::from_secs(120))
                .unwrap(),
        );
        let (status, _, body) = get().unwrap();
        assert_eq!(status, 503);
        assert!(body.contains("\"serviceProxyHealthy\":false"), "{body}");
        health.updated();
        // The NodePort addresses change: the server moves, the old address refuses.
        tx.send(on([127, 0, 0, 2], one.clone())).unwrap();
        wait(None);
        let moved = SocketAddr::from(([127, 0, 0, 2], port));
        assert_eq!(
            http::get(moved, "/", Duration::from_secs(2)).unwrap().0,
            200
        );
        tx.send(on([127, 0, 0, 1], one)).unwrap();
        wait(Some(200));
        // Removed from the map: the port closes.
        tx.send(on([127, 0, 0, 1], HcDesired::new())).unwrap();
        wait(None);
        drop(tx);
        thread.join().unwrap();
    }
}
