//! Conversion of kube objects (k8s-openapi types) into the model. The only place that reads kube types
//! besides the watchers: nothing below `source` sees them.
//!
//! Invalid input rejects the whole object with a [`ConvertError`] naming it ("namespace/name") and the
//! reason. Objects the proxy has nothing to do with (headless and ExternalName services, FQDN slices)
//! are not errors: they convert to `Skipped` with a reason.

use std::collections::BTreeSet;
use std::net::IpAddr;
use std::str::FromStr;
use std::sync::Arc;

use k8s_openapi::api::core::v1::Service;
use k8s_openapi::api::discovery::v1::{
    Endpoint, EndpointConditions, EndpointHints, EndpointPort, EndpointSlice,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

use super::validate;
use nftkube_model::{
    parse_ip_sloppy, Cidr, Created, IpFamily, NamespacedName, Protocol, ServicePort,
    ServicePortName, ServiceType, SharedValues, SliceEndpoint, SliceInfo, SlicePort, Topology,
    TrafficPolicy,
};

/// Label of an EndpointSlice naming the service it belongs to.
pub(crate) const SERVICE_NAME_LABEL: &str = "kubernetes.io/service-name";
/// ClientIP affinity timeout when the Service does not set one (kube's default, 3 hours).
pub(crate) const DEFAULT_AFFINITY_TIMEOUT: u32 = 10800;
/// Largest ClientIP affinity timeout the API accepts (one day).
pub(crate) const MAX_AFFINITY_TIMEOUT: i32 = 86400;

/// An object that cannot be converted; the whole object is rejected.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{kind} {object}: {reason}")]
pub struct ConvertError {
    /// "Service" or "EndpointSlice".
    pub kind: &'static str,
    /// "namespace/name" (`namespace/<unnamed>` if the name is missing).
    pub(crate) object: String,
    /// Why the object was not used.
    pub(crate) reason: String,
}

/// Result of converting a Service.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ServiceConversion {
    /// The service's ports (possibly none).
    Ports(Vec<ServicePort>),
    /// A service the proxy does not handle (headless, ExternalName, no cluster IP), with the reason.
    Skipped(String),
}

/// Result of converting an EndpointSlice.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SliceConversion {
    /// An EndpointSlice.
    Slice(SliceInfo),
    /// A slice the proxy does not handle (addressType FQDN), with the reason.
    Skipped(String),
}

/// How an object's name is checked: the API server's rule for its kind.
type NameRule = fn(&str, &str) -> Result<(), String>;

/// Namespace ("default" if unset) and name of an object, checked as the API server checks them (see
/// `validate`); the error for a missing or refused name.
fn object_key(
    kind: &'static str,
    meta: &ObjectMeta,
    name_rule: NameRule,
) -> Result<NamespacedName, ConvertError> {
    let namespace = meta
        .namespace
        .as_deref()
        .filter(|n| !n.is_empty())
        .unwrap_or("default");
    let refused = |object: String, reason: String| ConvertError {
        kind,
        object,
        reason,
    };
    let Some(name) = meta.name.as_deref().filter(|n| !n.is_empty()) else {
        return Err(refused(
            format!("{namespace}/<unnamed>"),
            "missing metadata.name".into(),
        ));
    };
    // A refused name is not repeated whole in the object's description: the reason shows a prefix.
    let short = validate::shortened;
    validate::dns1123_label("metadata.namespace", namespace)
        .map_err(|r| refused(format!("{}/{}", short(namespace), short(name)), r))?;
    name_rule("metadata.name", name)
        .map_err(|r| refused(format!("{namespace}/{}", short(name)), r))?;
    Ok(NamespacedName::new(namespace, name))
}

/// An address as the API server validated it (Go's `ParseIPSloppy`: leading zeros decimal, an IPv4-mapped
/// address IPv4; see `model::ip_text`): refusing what it stored would keep an older version in effect.
fn parse_ip(what: &str, s: &str) -> Result<IpAddr, String> {
    parse_ip_sloppy(s).ok_or_else(|| format!("invalid {what} {s:?}"))
}

fn parse_port(what: &str, p: i32) -> Result<u16, String> {
    u16::try_from(p)
        .ok()
        .filter(|p| *p != 0)
        .ok_or_else(|| format!("{what} {p} out of range (1-65535)"))
}

/// An optional port where 0 means "not allocated" (how the API spells unset).
fn parse_optional_port(what: &str, p: Option<i32>) -> Result<Option<u16>, String> {
    match p {
        None | Some(0) => Ok(None),
        Some(p) => parse_port(what, p).map(Some),
    }
}

fn parse_protocol(p: Option<&str>) -> Result<Protocol, String> {
    Protocol::from_str(p.unwrap_or("")).map_err(|e| e.to_string())
}

fn parse_traffic_policy(field: &str, v: Option<&str>) -> Result<TrafficPolicy, String> {
    match v.unwrap_or("") {
        "" | "Cluster" => Ok(TrafficPolicy::Cluster),
        "Local" => Ok(TrafficPolicy::Local),
        other => Err(format!("unknown {field} {other:?}")),
    }
}

/// Converts a Service into its ports.
pub fn service_ports(svc: &Service) -> Result<ServiceConversion, ConvertError> {
    let key = object_key("Service", &svc.metadata, validate::service_name)?;
    convert_service(&key, svc).map_err(|reason| ConvertError {
        kind: "Service",
        object: key.to_string(),
        reason,
    })
}

fn convert_service(key: &NamespacedName, svc: &Service) -> Result<ServiceConversion, String> {
    let Some(spec) = svc.spec.as_ref() else {
        return Ok(ServiceConversion::Skipped("no spec".into()));
    };
    let service_type = match spec.type_.as_deref().unwrap_or("") {
        "" | "ClusterIP" => ServiceType::ClusterIP,
        "NodePort" => ServiceType::NodePort,
        "LoadBalancer" => ServiceType::LoadBalancer,
        "ExternalName" => return Ok(ServiceConversion::Skipped("type ExternalName".into())),
        other => return Err(format!("unknown service type {other:?}")),
    };

    let ip_strings: Vec<&str> = match spec.cluster_ips.as_deref() {
        Some(ips) if !ips.is_empty() => ips.iter().map(String::as_str).collect(),
        _ => spec
            .cluster_ip
            .as_deref()
            .into_iter()
            .filter(|s| !s.is_empty())
            .collect(),
    };
    match ip_strings.first() {
        None => return Ok(ServiceConversion::Skipped("no clusterIP".into())),
        Some(&"None") => {
            return Ok(ServiceConversion::Skipped(
                "headless (clusterIP None)".into(),
            ))
        }
        Some(_) => {}
    }
    let mut cluster_ips = Vec::with_capacity(ip_strings.len());
    for s in ip_strings {
        let ip = parse_ip("clusterIP", s)?;
        if !cluster_ips.contains(&ip) {
            cluster_ips.push(ip);
        }
    }

    let external_ips = spec
        .external_ips
        .iter()
        .flatten()
        .map(|s| parse_ip("externalIP", s))
        .collect::<Result<Vec<_>, _>>()?;

    let mut load_balancer_ips = Vec::new();
    let ingress = svc
        .status
        .as_ref()
        .and_then(|s| s.load_balancer.as_ref())
        .and_then(|lb| lb.ingress.as_ref());
    for ing in ingress.into_iter().flatten() {
        // Proxy-mode load balancers deliver traffic to the nodes, not to the VIP: nothing to program.
        if ing.ip_mode.as_deref() == Some("Proxy") {
            continue;
        }
        if let Some(ip) = ing.ip.as_deref().filter(|s| !s.is_empty()) {
            let ip = parse_ip("load balancer ingress IP", ip)?;
            if !load_balancer_ips.contains(&ip) {
                load_balancer_ips.push(ip);
            }
        }
    }

    let load_balancer_source_ranges = spec
        .load_balancer_source_ranges
        .iter()
        .flatten()
        .map(|s| {
            Cidr::from_str(s.trim())
                .map_err(|e| format!("invalid loadBalancerSourceRanges entry: {e}"))
        })
        .collect::<Result<Vec<_>, _>>()?;

    let external_traffic_policy = parse_traffic_policy(
        "externalTrafficPolicy",
        spec.external_traffic_policy.as_deref(),
    )?;
    let internal_traffic_policy = parse_traffic_policy(
        "internalTrafficPolicy",
        spec.internal_traffic_policy.as_deref(),
    )?;

    let session_affinity_timeout = match spec.session_affinity.as_deref().unwrap_or("") {
        "" | "None" => None,
        "ClientIP" => {
            let t = spec
                .session_affinity_config
                .as_ref()
                .and_then(|c| c.client_ip.as_ref())
                .and_then(|c| c.timeout_seconds);
            match t {
                None => Some(DEFAULT_AFFINITY_TIMEOUT),
                Some(t) if t > 0 && t <= MAX_AFFINITY_TIMEOUT => Some(t as u32),
                Some(t) => {
                    return Err(format!(
                        "sessionAffinityConfig.clientIP.timeoutSeconds {t} out of range (1-{MAX_AFFINITY_TIMEOUT})"
                    ))
                }
            }
        }
        other => return Err(format!("unknown sessionAffinity {other:?}")),
    };

    let health_check_node_port =
        parse_optional_port("healthCheckNodePort", spec.health_check_node_port)?;
    let created = created(&svc.metadata);

    let spec_ports = spec.ports.as_deref().unwrap_or(&[]);
    let mut names = BTreeSet::new();
    let mut ports = Vec::with_capacity(spec_ports.len());
    for (i, p) in spec_ports.iter().enumerate() {
        let name = p.name.clone().unwrap_or_default();
        if name.is_empty() && spec_ports.len() > 1 {
            return Err(format!(
                "ports[{i}]: missing name (required when a service has several ports)"
            ));
        }
        if !name.is_empty() {
            validate::iana_svc_name(&format!("ports[{i}].name"), &name)?;
        }
        if !names.insert(name.clone()) {
            return Err(format!("ports[{i}]: duplicate port name {name:?}"));
        }
        let port = parse_port(&format!("ports[{i}]: port"), p.port)?;
        let protocol =
            parse_protocol(p.protocol.as_deref()).map_err(|e| format!("ports[{i}]: {e}"))?;
        let node_port = parse_optional_port(&format!("ports[{i}]: nodePort"), p.node_port)?;
        ports.push(ServicePort {
            name: ServicePortName {
                service: key.clone(),
                port: name.into(),
                protocol,
            },
            service_type,
            cluster_ips: cluster_ips.clone(),
            port,
            protocol,
            // A ClusterIP service has no node port (the API clears it when the type changes).
            node_port: node_port.filter(|_| service_type != ServiceType::ClusterIP),
            external_ips: external_ips.clone(),
            load_balancer_ips: load_balancer_ips.clone(),
            load_balancer_source_ranges: load_balancer_source_ranges.clone(),
            external_traffic_policy,
            internal_traffic_policy,
            session_affinity_timeout,
            health_check_node_port,
            created,
        });
    }
    Ok(ServiceConversion::Ports(ports))
}

/// `metadata.creationTimestamp`, which ranks services claiming one frontend (see `render::claims`).
fn created(meta: &ObjectMeta) -> Created {
    meta.creation_timestamp
        .as_ref()
        .map_or(Created::UNKNOWN, |t| {
            Created::from_unix_seconds(t.0.as_second())
        })
}

/// Converts an EndpointSlice (the tests' entry: manifests share values across a read, the API watcher reads
/// its own type).
#[cfg(test)]
pub(crate) fn endpoint_slice(slice: &EndpointSlice) -> Result<SliceConversion, ConvertError> {
    endpoint_slice_sharing(slice, &mut SharedValues::default())
}

/// Converts an EndpointSlice, taking namespaces, port names and endpoint topologies from `shared`: the
/// slices of one read then hold one copy of each before they reach the store.
pub(crate) fn endpoint_slice_sharing(
    slice: &EndpointSlice,
    shared: &mut SharedValues,
) -> Result<SliceConversion, ConvertError> {
    slice_fields_sharing(
        &SliceFields {
            metadata: &slice.metadata,
            address_type: &slice.address_type,
            ports: slice.ports.as_deref(),
            endpoints: &slice.endpoints,
        },
        shared,
    )
}

/// What the conversion reads of an endpoint: k8s-openapi's `Endpoint` (manifests), or the API watcher's
/// lean one (`kube::slice_wire`), which skips on its way in what the proxy never reads.
pub(crate) trait EndpointFields {
    /// `addresses`.
    fn addresses(&self) -> &[String];
    /// `conditions`.
    fn conditions(&self) -> Option<&EndpointConditions>;
    /// `nodeName`, `zone` and `hints`.
    fn topology(&self) -> Topology;
}

impl EndpointFields for Endpoint {
    fn addresses(&self) -> &[String] {
        &self.addresses
    }
    fn conditions(&self) -> Option<&EndpointConditions> {
        self.conditions.as_ref()
    }
    fn topology(&self) -> Topology {
        topology(
            self.node_name.as_ref(),
            self.zone.as_ref(),
            self.hints.as_ref(),
        )
    }
}

/// What the conversion reads of an EndpointSlice, whichever type it was read into.
pub(crate) struct SliceFields<'a, E> {
    pub(crate) metadata: &'a ObjectMeta,
    pub(crate) address_type: &'a str,
    pub(crate) ports: Option<&'a [EndpointPort]>,
    pub(crate) endpoints: &'a [E],
}

/// [`endpoint_slice_sharing`] of the fields of either type.
pub(crate) fn slice_fields_sharing<E: EndpointFields>(
    slice: &SliceFields<'_, E>,
    shared: &mut SharedValues,
) -> Result<SliceConversion, ConvertError> {
    let key = object_key("EndpointSlice", slice.metadata, validate::dns1123_subdomain)?;
    convert_slice(&key, slice, shared).map_err(|reason| ConvertError {
        kind: "EndpointSlice",
        object: key.to_string(),
        reason,
    })
}

fn convert_slice<E: EndpointFields>(
    key: &NamespacedName,
    slice: &SliceFields<'_, E>,
    shared: &mut SharedValues,
) -> Result<SliceConversion, String> {
    let service: Arc<str> = slice
        .metadata
        .labels
        .as_ref()
        .and_then(|l| l.get(SERVICE_NAME_LABEL))
        .filter(|s| !s.is_empty())
        .ok_or_else(|| format!("missing label {SERVICE_NAME_LABEL}"))?
        .as_str()
        .into();
    validate::label_value(&format!("label {SERVICE_NAME_LABEL}"), &service)?;
    let address_type = match slice.address_type {
        "IPv4" => IpFamily::V4,
        "IPv6" => IpFamily::V6,
        "FQDN" => return Ok(SliceConversion::Skipped("addressType FQDN".into())),
        other => return Err(format!("unknown addressType {other:?}")),
    };

    let mut ports = Vec::new();
    for (i, p) in slice.ports.into_iter().flatten().enumerate() {
        // A nil port means "all ports"; kube-proxy cannot use that and ignores it.
        let Some(port) = p.port else {
            tracing::debug!(slice = %key, index = i, "ignoring EndpointSlice port without a port number");
            continue;
        };
        let name = p.name.as_deref().unwrap_or_default();
        if !name.is_empty() {
            validate::dns1123_label(&format!("ports[{i}].name"), name)?;
        }
        ports.push(SlicePort {
            name: shared.string(name),
            port: parse_port(&format!("ports[{i}]: port"), port)?,
            protocol: parse_protocol(p.protocol.as_deref())
                .map_err(|e| format!("ports[{i}]: {e}"))?,
        });
    }
    ports.shrink_to_fit();

    let mut endpoints = Vec::with_capacity(slice.endpoints.len());
    let mut without_addresses = 0usize;
    for (i, ep) in slice.endpoints.iter().enumerate() {
        if ep.addresses().is_empty() {
            // kube-proxy skips such an endpoint and keeps the rest of the slice.
            without_addresses += 1;
            continue;
        }
        let address = first_address(ep.addresses(), address_type, slice.address_type)
            .map_err(|e| format!("endpoints[{i}]: {e}"))?;
        let cond = ep.conditions();
        // As kube-proxy reads them: a nil ready or serving is true (unknown counts as usable), a nil
        // terminating is false.
        let ready = cond.and_then(|c| c.ready).unwrap_or(true);
        let serving = cond.and_then(|c| c.serving).unwrap_or(true);
        let terminating = cond.and_then(|c| c.terminating).unwrap_or(false);
        endpoints.push(SliceEndpoint {
            address,
            ready,
            serving,
            terminating,
            topology: shared.topology(ep.topology()),
        });
    }

    if without_addresses > 0 {
        // One line per slice, whatever the count: a slice of empty endpoints must not flood the log.
        tracing::warn!(slice = %key, endpoints = without_addresses, "ignoring endpoints without addresses");
    }
    Ok(SliceConversion::Slice(SliceInfo {
        namespace: shared.string(&key.namespace),
        name: key.name.clone(),
        service,
        address_type,
        ports,
        endpoints,
    }))
}

/// Validates every address of an endpoint and returns the first: consumers use only that one (the API
/// says they are fungible; kube-proxy programs the first), so only it is kept.
fn first_address(
    addresses: &[String],
    family: IpFamily,
    address_type: &str,
) -> Result<IpAddr, String> {
    let mut first = None;
    for a in addresses {
        let ip = parse_ip("endpoint address", a)?;
        if IpFamily::of(&ip) != family {
            return Err(format!(
                "address {a:?} does not match addressType {address_type}"
            ));
        }
        first.get_or_insert(ip);
    }
    first.ok_or_else(|| "no addresses".to_string())
}

/// Node, zone and topology hints of an endpoint.
pub(crate) fn topology(
    node_name: Option<&String>,
    zone: Option<&String>,
    hints: Option<&EndpointHints>,
) -> Topology {
    Topology {
        node_name: node_name.cloned(),
        zone: zone.cloned(),
        zone_hints: hints
            .and_then(|h| h.for_zones.as_ref())
            .map(|z| z.iter().map(|z| z.name.clone()).collect())
            .unwrap_or_default(),
        node_hints: hints
            .and_then(|h| h.for_nodes.as_ref())
            .map(|n| n.iter().map(|n| n.name.clone()).collect())
            .unwrap_or_default(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn svc(json: serde_json::Value) -> Service {
        serde_json::from_value(json).unwrap()
    }

    fn ports(s: &Service) -> Vec<ServicePort> {
        match service_ports(s).unwrap() {
            ServiceConversion::Ports(p) => p,
            ServiceConversion::Skipped(r) => panic!("skipped: {r}"),
        }
    }

    fn err(s: &Service) -> ConvertError {
        service_ports(s).unwrap_err()
    }

    fn base(spec: serde_json::Value) -> Service {
        svc(serde_json::json!({
            "apiVersion": "v1", "kind": "Service",
            "metadata": {"name": "web", "namespace": "demo"},
            "spec": spec,
        }))
    }

    #[test]
    fn names_the_api_server_would_refuse_reject_the_object_and_name_it() {
        let named = |ns: &str, name: &str, port: &str| {
            svc(serde_json::json!({
                "apiVersion": "v1", "kind": "Service",
                "metadata": {"name": name, "namespace": ns},
                "spec": {"clusterIP": "10.96.0.9", "ports": [{"name": port, "port": 80}]},
            }))
        };
        let long = "x".repeat(300);
        let e = err(&named("demo", &long, "http"));
        assert!(e.reason.contains("not a Service name"), "{e}");
        assert!(
            e.object.len() < 80 && e.object.starts_with("demo/xxx"),
            "{e}"
        );
        let e = err(&named(&long, "web", "http"));
        assert!(e.reason.contains("metadata.namespace"), "{e}");
        let e = err(&named("demo", "web", "a-port-name-too-long"));
        assert!(
            e.reason.contains("ports[0].name") && e.reason.contains("IANA"),
            "{e}"
        );
        assert!(err(&named("Demo", "web", "http"))
            .reason
            .contains("DNS-1123"));
        assert_eq!(ports(&named("demo", "web", "http")).len(), 1);
        // KEP-5311 (GA in 1.37): a Service name may start with a digit.
        assert_eq!(ports(&named("demo", "1web", "http")).len(), 1);
    }

    #[test]
    fn the_creation_time_ranks_the_service() {
        let mut s = base(serde_json::json!({"clusterIP": "10.96.0.9", "ports": [{"port": 80}]}));
        assert_eq!(ports(&s)[0].created, Created::UNKNOWN);
        s.metadata.creation_timestamp =
            serde_json::from_value(serde_json::json!("2024-01-02T03:04:05Z")).unwrap();
        assert_eq!(
            ports(&s)[0].created,
            Created::from_unix_seconds(1_704_164_645)
        );
    }

    #[test]
    fn full_load_balancer_service() {
        let s = svc(serde_json::json!({
            "apiVersion": "v1", "kind": "Service",
            "metadata": {"name": "lb"},
            "spec": {
                "type": "LoadBalancer",
                "clusterIP": "10.96.0.5",
                "clusterIPs": ["10.96.0.5", "fd00::5"],
                "externalIPs": ["192.0.2.1"],
                "loadBalancerSourceRanges": [" 203.0.113.0/24 ", "2001:db8::/32"],
                "externalTrafficPolicy": "Local",
                "internalTrafficPolicy": "Local",
                "healthCheckNodePort": 32000,
                "sessionAffinity": "ClientIP",
                "sessionAffinityConfig": {"clientIP": {"timeoutSeconds": 60}},
                "ports": [
                    {"name": "http", "port": 80, "targetPort": 8080, "nodePort": 30080},
                    {"name": "dns", "port": 53, "protocol": "UDP", "nodePort": 30053},
                ],
            },
            "status": {"loadBalancer": {"ingress": [
                {"ip": "198.51.100.1"},
                {"ip": "198.51.100.2", "ipMode": "Proxy"},
                {"ip": "198.51.100.3", "ipMode": "VIP"},
                {"hostname": "lb.example.com"},
            ]}},
        }));
        let p = ports(&s);
        assert_eq!(p.len(), 2);
        let http = &p[0];
        assert_eq!(http.name.service, NamespacedName::new("default", "lb"));
        assert_eq!(&*http.name.port, "http");
        assert_eq!(http.name.protocol, Protocol::Tcp);
        assert_eq!(http.protocol, Protocol::Tcp);
        assert_eq!(http.service_type, ServiceType::LoadBalancer);
        assert_eq!(
            http.cluster_ips,
            vec![
                "10.96.0.5".parse::<IpAddr>().unwrap(),
                "fd00::5".parse().unwrap()
            ]
        );
        assert_eq!(http.port, 80);
        assert_eq!(http.node_port, Some(30080));
        assert_eq!(
            http.external_ips,
            vec!["192.0.2.1".parse::<IpAddr>().unwrap()]
        );
        assert_eq!(
            http.load_balancer_ips,
            vec![
                "198.51.100.1".parse::<IpAddr>().unwrap(),
                "198.51.100.3".parse().unwrap()
            ]
        );
        assert_eq!(
            http.load_balancer_source_ranges,
            vec![
                "203.0.113.0/24".parse::<Cidr>().unwrap(),
                "2001:db8::/32".parse().unwrap()
            ]
        );
        assert_eq!(http.external_traffic_policy, TrafficPolicy::Local);
        assert_eq!(http.internal_traffic_policy, TrafficPolicy::Local);
        assert_eq!(http.session_affinity_timeout, Some(60));
        assert_eq!(http.health_check_node_port, Some(32000));
        assert_eq!(p[1].protocol, Protocol::Udp);
        assert_eq!(p[1].name.protocol, Protocol::Udp);
        assert_eq!(p[1].node_port, Some(30053));
    }

    #[test]
    fn defaults() {
        let p = ports(&base(serde_json::json!({
            "clusterIP": "10.96.0.7",
            "sessionAffinity": "ClientIP",
            "ports": [{"port": 443}],
        })));
        assert_eq!(p.len(), 1);
        let p = &p[0];
        assert_eq!(p.name.to_string(), "demo/web");
        assert_eq!(&*p.name.port, "");
        assert_eq!(p.protocol, Protocol::Tcp);
        assert_eq!(p.service_type, ServiceType::ClusterIP);
        assert_eq!(p.cluster_ips, vec!["10.96.0.7".parse::<IpAddr>().unwrap()]);
        assert_eq!(p.external_traffic_policy, TrafficPolicy::Cluster);
        assert_eq!(p.internal_traffic_policy, TrafficPolicy::Cluster);
        assert_eq!(p.session_affinity_timeout, Some(DEFAULT_AFFINITY_TIMEOUT));
        assert_eq!(p.node_port, None);
        assert_eq!(p.health_check_node_port, None);
        assert!(p.external_ips.is_empty() && p.load_balancer_ips.is_empty());
        let p = ports(&base(serde_json::json!({
            "clusterIP": "10.96.0.7",
            "externalTrafficPolicy": "Cluster",
            "sessionAffinity": "None",
            "ports": [{"port": 443, "protocol": "SCTP"}],
        })));
        assert_eq!(p[0].session_affinity_timeout, None);
        assert_eq!(p[0].protocol, Protocol::Sctp);
    }

    #[test]
    fn skipped_services() {
        let cases = [
            serde_json::json!({"clusterIP": "None", "ports": [{"port": 80}]}),
            serde_json::json!({"clusterIPs": ["None"], "ports": [{"port": 80}]}),
            serde_json::json!({"type": "ExternalName", "externalName": "example.com"}),
            serde_json::json!({"ports": [{"port": 80}]}),
        ];
        for spec in cases {
            let r = service_ports(&base(spec.clone())).unwrap();
            assert!(matches!(r, ServiceConversion::Skipped(_)), "{spec}: {r:?}");
        }
    }

    #[test]
    fn invalid_services_are_rejected() {
        let cases = [
            (
                serde_json::json!({"clusterIP": "10.0.0.300", "ports": [{"port": 80}]}),
                "invalid clusterIP \"10.0.0.300\"",
            ),
            (
                serde_json::json!({"clusterIPs": ["10.0.0.1", "fd00::zz"], "ports": [{"port": 80}]}),
                "invalid clusterIP \"fd00::zz\"",
            ),
            (
                serde_json::json!({"clusterIP": "10.0.0.1", "externalIPs": ["nope"], "ports": [{"port": 80}]}),
                "invalid externalIP \"nope\"",
            ),
            (
                serde_json::json!({"clusterIP": "10.0.0.1", "ports": [{"port": 0}]}),
                "port 0 out of range",
            ),
            (
                serde_json::json!({"clusterIP": "10.0.0.1", "ports": [{"port": 65536}]}),
                "port 65536 out of range",
            ),
            (
                serde_json::json!({"type": "NodePort", "clusterIP": "10.0.0.1", "ports": [{"port": 80, "nodePort": 70000}]}),
                "nodePort 70000 out of range",
            ),
            (
                serde_json::json!({"clusterIP": "10.0.0.1", "ports": [{"port": 80, "protocol": "ICMP"}]}),
                "unsupported protocol \"ICMP\"",
            ),
            (
                serde_json::json!({"clusterIP": "10.0.0.1", "ports": [{"name": "a", "port": 80}, {"port": 81}]}),
                "missing name",
            ),
            (
                serde_json::json!({"clusterIP": "10.0.0.1", "ports": [{"name": "a", "port": 80}, {"name": "a", "port": 81, "protocol": "UDP"}]}),
                "duplicate port name \"a\"",
            ),
            (
                serde_json::json!({"clusterIP": "10.0.0.1", "loadBalancerSourceRanges": ["10.0.0.0/33"], "ports": [{"port": 80}]}),
                "invalid loadBalancerSourceRanges entry",
            ),
            (
                serde_json::json!({"clusterIP": "10.0.0.1", "externalTrafficPolicy": "Nope", "ports": [{"port": 80}]}),
                "unknown externalTrafficPolicy",
            ),
            (
                serde_json::json!({"clusterIP": "10.0.0.1", "sessionAffinity": "ClientIP", "sessionAffinityConfig": {"clientIP": {"timeoutSeconds": 0}}, "ports": [{"port": 80}]}),
                "timeoutSeconds 0 out of range",
            ),
        ];
        for (spec, want) in cases {
            let e = err(&base(spec.clone()));
            assert_eq!(e.object, "demo/web");
            assert_eq!(e.kind, "Service");
            assert!(e.reason.contains(want), "{spec}: got {e}, want {want}");
            assert!(e.to_string().starts_with("Service demo/web: "), "{e}");
        }
        // Invalid LB ingress IP.
        let mut s = base(serde_json::json!({"clusterIP": "10.0.0.1", "ports": [{"port": 80}]}));
        s.status = Some(
            serde_json::from_value(
                serde_json::json!({"loadBalancer": {"ingress": [{"ip": "1.2.3"}]}}),
            )
            .unwrap(),
        );
        assert!(err(&s)
            .reason
            .contains("invalid load balancer ingress IP \"1.2.3\""));
        // Missing name.
        let s = svc(
            serde_json::json!({"apiVersion": "v1", "kind": "Service", "metadata": {"namespace": "x"},
            "spec": {"clusterIP": "10.0.0.1", "ports": [{"port": 80}]}}),
        );
        let e = err(&s);
        assert_eq!(e.object, "x/<unnamed>");
        assert!(e.reason.contains("missing metadata.name"));
    }

    #[test]
    fn addresses_read_as_the_api_server_accepts_them() {
        let mut s = base(serde_json::json!({
            "type": "LoadBalancer",
            "clusterIPs": ["::ffff:10.96.0.9", "fd00:0000::0009"],
            "externalIPs": ["192.000.002.001", "::ffff:192.0.2.2"],
            "loadBalancerSourceRanges": ["010.20.0.0/16", "::ffff:10.30.0.0/112"],
            "ports": [{"port": 80, "nodePort": 30080}],
        }));
        s.status = Some(
            serde_json::from_value(serde_json::json!({"loadBalancer": {"ingress": [
                {"ip": "198.051.100.001"}, {"ip": "::ffff:198.51.100.2"},
            ]}}))
            .unwrap(),
        );
        let p = &ports(&s)[0];
        let strings = |v: &[IpAddr]| v.iter().map(IpAddr::to_string).collect::<Vec<_>>();
        // The mapped cluster IP is IPv4: it lands in the ip table, not ip6.
        assert_eq!(strings(&p.cluster_ips), ["10.96.0.9", "fd00::9"]);
        assert_eq!(IpFamily::of(&p.cluster_ips[0]), IpFamily::V4);
        assert_eq!(strings(&p.external_ips), ["192.0.2.1", "192.0.2.2"]);
        assert_eq!(
            strings(&p.load_balancer_ips),
            ["198.51.100.1", "198.51.100.2"]
        );
        let ranges: Vec<String> = p
            .load_balancer_source_ranges
            .iter()
            .map(Cidr::to_string)
            .collect();
        assert_eq!(ranges, ["10.20.0.0/16", "10.30.0.0/16"]);
    }

    #[test]
    fn garbage_addresses_are_still_refused_with_the_field_named() {
        let cases = [
            (serde_json::json!({"clusterIP": "10.0.0.0256", "ports": [{"port": 80}]}), "invalid clusterIP \"10.0.0.0256\""),
            (serde_json::json!({"clusterIP": "10.0.0.1", "externalIPs": ["::ffff:1.2.3"], "ports": [{"port": 80}]}), "invalid externalIP \"::ffff:1.2.3\""),
            (serde_json::json!({"clusterIP": "10.0.0.1", "loadBalancerSourceRanges": ["010.20.0.0/+16"], "ports": [{"port": 80}]}), "invalid loadBalancerSourceRanges entry: invalid CIDR \"010.20.0.0/+16\": bad prefix length"),
            (serde_json::json!({"clusterIP": "10.0.0.1", "loadBalancerSourceRanges": ["10.20.0.0x/16"], "ports": [{"port": 80}]}), "bad address"),
        ];
        for (spec, want) in cases {
            let e = err(&base(spec.clone()));
            assert!(e.reason.contains(want), "{spec}: got {e}, want {want}");
        }
    }

    fn slice(json: serde_json::Value) -> EndpointSlice {
        serde_json::from_value(json).unwrap()
    }

    #[test]
    fn endpoint_slice_conversion() {
        let s = slice(serde_json::json!({
            "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
            "metadata": {"name": "echo-abc", "namespace": "demo", "labels": {"kubernetes.io/service-name": "echo"}},
            "addressType": "IPv4",
            "ports": [
                {"name": "tcp", "port": 8080, "protocol": "TCP"},
                {"port": 5353, "protocol": "UDP"},
                {"name": "all"},
            ],
            "endpoints": [
                {"addresses": ["10.244.1.2"], "conditions": {"ready": true}, "nodeName": "node-1", "zone": "z1",
                 "hints": {"forZones": [{"name": "z1"}], "forNodes": [{"name": "node-1"}]}},
                {"addresses": ["10.244.2.2"]},
                {"addresses": ["10.244.3.2"], "conditions": {"ready": false, "serving": true, "terminating": true}},
                {"addresses": ["10.244.4.2"], "conditions": {"ready": false}},
                {"addresses": ["10.244.5.2"], "conditions": {"ready": false, "terminating": true}},
            ],
        }));
        let SliceConversion::Slice(info) = endpoint_slice(&s).unwrap() else {
            panic!("skipped")
        };
        assert_eq!(&*info.namespace, "demo");
        assert_eq!(&*info.name, "echo-abc");
        assert_eq!(&*info.service, "echo");
        assert_eq!(info.address_type, IpFamily::V4);
        assert_eq!(
            info.ports,
            vec![
                SlicePort {
                    name: "tcp".into(),
                    port: 8080,
                    protocol: Protocol::Tcp
                },
                SlicePort {
                    name: "".into(),
                    port: 5353,
                    protocol: Protocol::Udp
                },
            ]
        );
        let e = &info.endpoints;
        assert_eq!(e.len(), 5);
        assert_eq!(e[0].address, "10.244.1.2".parse::<IpAddr>().unwrap());
        assert!(e[0].ready && e[0].serving && !e[0].terminating);
        assert_eq!(e[0].node_name(), Some("node-1"));
        assert_eq!(e[0].zone(), Some("z1"));
        assert_eq!(e[0].zone_hints(), ["z1".to_string()]);
        assert_eq!(e[0].node_hints(), ["node-1".to_string()]);
        // Nothing about the node or zone: no topology at all.
        assert_eq!(e[1].topology, None);
        assert_eq!(e[1].node_name(), None);
        assert!(e[1].zone_hints().is_empty());
        // No conditions at all: ready and serving, not terminating.
        assert!(e[1].ready && e[1].serving && !e[1].terminating);
        assert!(!e[2].ready && e[2].serving && e[2].terminating);
        // serving unset is true, whatever ready says (kube-proxy's endpointslicecache).
        assert!(!e[3].ready && e[3].serving && !e[3].terminating);
        assert!(!e[4].ready && e[4].serving && e[4].terminating);
    }

    #[test]
    fn endpoint_keeps_its_first_address_and_validates_all() {
        let mk = |addrs: serde_json::Value| {
            slice(serde_json::json!({
                "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
                "metadata": {"name": "s", "labels": {"kubernetes.io/service-name": "svc"}},
                "addressType": "IPv4",
                "ports": [{"name": "p", "port": 80}],
                "endpoints": [{"addresses": addrs}],
            }))
        };
        let SliceConversion::Slice(info) =
            endpoint_slice(&mk(serde_json::json!(["10.0.0.2", "10.0.0.1"]))).unwrap()
        else {
            panic!("skipped")
        };
        assert_eq!(info.endpoints[0].address.to_string(), "10.0.0.2");
        let e = endpoint_slice(&mk(serde_json::json!(["10.0.0.2", "10.0.0.x"]))).unwrap_err();
        assert_eq!(
            e.reason,
            "endpoints[0]: invalid endpoint address \"10.0.0.x\""
        );
        let e = endpoint_slice(&mk(serde_json::json!(["10.0.0.2", "fd00::1"]))).unwrap_err();
        assert_eq!(
            e.reason,
            "endpoints[0]: address \"fd00::1\" does not match addressType IPv4"
        );
    }

    #[test]
    fn an_endpoint_without_addresses_is_skipped_and_the_rest_of_the_slice_kept() {
        let s = slice(serde_json::json!({
            "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
            "metadata": {"name": "s", "labels": {"kubernetes.io/service-name": "svc"}},
            "addressType": "IPv4",
            "ports": [{"name": "p", "port": 80}],
            "endpoints": [{"addresses": []}, {"addresses": ["10.0.0.3"]}],
        }));
        let SliceConversion::Slice(info) = endpoint_slice(&s).unwrap() else {
            panic!("skipped")
        };
        let kept: Vec<String> = info
            .endpoints
            .iter()
            .map(|e| e.address.to_string())
            .collect();
        assert_eq!(kept, ["10.0.0.3"]);
        // A hostile slice: 100 000 endpoints without addresses around one good one. Skipped in one pass (one
        // warning for the slice), and the good endpoint still serves.
        let mut endpoints = vec![serde_json::json!({"addresses": []}); 100_000];
        endpoints.insert(50_000, serde_json::json!({"addresses": ["10.0.0.4"]}));
        let s = slice(serde_json::json!({
            "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
            "metadata": {"name": "s", "labels": {"kubernetes.io/service-name": "svc"}},
            "addressType": "IPv4",
            "ports": [{"name": "p", "port": 80}],
            "endpoints": endpoints,
        }));
        let SliceConversion::Slice(info) = endpoint_slice(&s).unwrap() else {
            panic!("skipped")
        };
        assert_eq!(info.endpoints.len(), 1);
        assert_eq!(info.endpoints[0].address.to_string(), "10.0.0.4");
    }

    #[test]
    fn endpoint_addresses_read_as_the_api_server_accepts_them() {
        let mk = |address_type: &str, addrs: serde_json::Value| {
            slice(serde_json::json!({
                "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
                "metadata": {"name": "s", "labels": {"kubernetes.io/service-name": "svc"}},
                "addressType": address_type,
                "ports": [{"name": "p", "port": 80}],
                "endpoints": [{"addresses": addrs}],
            }))
        };
        let first = |s: &EndpointSlice| match endpoint_slice(s).unwrap() {
            SliceConversion::Slice(info) => info.endpoints[0].address,
            SliceConversion::Skipped(r) => panic!("skipped: {r}"),
        };
        // A mapped address in an IPv4 slice is that IPv4 address (the API server's IsValidIPv4Address).
        let ip = first(&mk("IPv4", serde_json::json!(["::ffff:10.244.1.5"])));
        assert_eq!(ip, "10.244.1.5".parse::<IpAddr>().unwrap());
        let ip = first(&mk("IPv4", serde_json::json!(["010.244.001.005"])));
        assert_eq!(ip, "10.244.1.5".parse::<IpAddr>().unwrap());
        let ip = first(&mk("IPv6", serde_json::json!(["fd00::0005"])));
        assert_eq!(ip, "fd00::5".parse::<IpAddr>().unwrap());
        // ... and so no IPv6 address: the API server refuses it in an IPv6 slice, and so do we.
        let e = endpoint_slice(&mk("IPv6", serde_json::json!(["::ffff:10.244.1.5"]))).unwrap_err();
        assert!(e.reason.contains("does not match addressType IPv6"), "{e}");
        let e = endpoint_slice(&mk("IPv4", serde_json::json!(["10.244.1.5x"]))).unwrap_err();
        assert_eq!(
            e.reason,
            "endpoints[0]: invalid endpoint address \"10.244.1.5x\""
        );
    }

    #[test]
    fn slices_converted_with_shared_values_share_them() {
        let mk = |name: &str| {
            slice(serde_json::json!({
                "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
                "metadata": {"name": name, "namespace": "demo", "labels": {"kubernetes.io/service-name": "svc"}},
                "addressType": "IPv4",
                "ports": [{"name": "p", "port": 80}],
                "endpoints": [
                    {"addresses": ["10.0.0.1"], "nodeName": "node-1", "zone": "z1"},
                    {"addresses": ["10.0.0.2"], "nodeName": "node-1", "zone": "z1"},
                ],
            }))
        };
        let mut shared = SharedValues::default();
        let convert =
            |name: &str, shared: &mut SharedValues| match endpoint_slice_sharing(&mk(name), shared)
                .unwrap()
            {
                SliceConversion::Slice(s) => s,
                SliceConversion::Skipped(r) => panic!("skipped: {r}"),
            };
        let a = convert("a", &mut shared);
        let b = convert("b", &mut shared);
        assert!(Arc::ptr_eq(&a.namespace, &b.namespace));
        assert!(Arc::ptr_eq(&a.ports[0].name, &b.ports[0].name));
        let topo = |s: &SliceInfo, i: usize| s.endpoints[i].topology.clone().unwrap();
        assert!(Arc::ptr_eq(&topo(&a, 0), &topo(&a, 1)));
        assert!(Arc::ptr_eq(&topo(&a, 0), &topo(&b, 0)));
        // Sharing does not change the result.
        assert_eq!(endpoint_slice(&mk("a")).unwrap(), SliceConversion::Slice(a));
    }

    #[test]
    fn endpoint_slice_errors_and_skips() {
        let mk = |labels: serde_json::Value, addr_type: &str, addr: &str| {
            slice(serde_json::json!({
                "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
                "metadata": {"name": "s", "labels": labels},
                "addressType": addr_type,
                "ports": [{"name": "p", "port": 80}],
                "endpoints": [{"addresses": [addr]}],
            }))
        };
        let label = serde_json::json!({"kubernetes.io/service-name": "svc"});
        let e = endpoint_slice(&mk(serde_json::json!({}), "IPv4", "10.0.0.1")).unwrap_err();
        assert_eq!(e.object, "default/s");
        assert!(
            e.reason
                .contains("missing label kubernetes.io/service-name"),
            "{e}"
        );
        let e = endpoint_slice(&mk(label.clone(), "IPv4", "10.0.0.256")).unwrap_err();
        assert_eq!(
            e.to_string(),
            "EndpointSlice default/s: endpoints[0]: invalid endpoint address \"10.0.0.256\""
        );
        let e = endpoint_slice(&mk(label.clone(), "IPv4", "fd00::1")).unwrap_err();
        assert!(e.reason.contains("does not match addressType IPv4"), "{e}");
        let r = endpoint_slice(&mk(label.clone(), "FQDN", "example.com")).unwrap();
        assert!(matches!(r, SliceConversion::Skipped(_)));
        let r = endpoint_slice(&mk(label, "IPv6", "fd00::1")).unwrap();
        assert!(matches!(r, SliceConversion::Slice(ref s) if s.address_type == IpFamily::V6));
    }
}
