//! Services, EndpointSlices and this Node from the Kubernetes API, as the same [`Event`]s the manifest
//! source emits, and the ServiceCIDRs (the API's alone: [`Event::ServiceCidrs`]).
//!
//! Four kube-runtime watchers (list, then watch from the list's resourceVersion, bookmarks on, a relist
//! after `410 Gone`, exponential backoff 0.2 s → 30 s with jitter (client-go starts at 0.8 s), starting over as
//! soon as the API answers the watcher again: [`super::backoff`]) run on a
//! single-threaded tokio runtime on a thread of their own; batches of events reach the (synchronous)
//! proxy loop through a channel. The runtime thread never changes network namespace: it inherits the one
//! of the thread that started it.
//!
//! Guarantees, implemented by [`Coordinator`] (pure, unit-tested without HTTP):
//! - **No sync on a partial view.** [`Event::Synced`] is sent once, after both Services and
//!   EndpointSlices completed their first list. The proxy loop does not touch the kernel before it.
//!   ServiceCIDRs are no part of it: a cluster without the resource (before 1.33) or without the right to
//!   list it still syncs; their watcher logs its failure once and keeps retrying (`service_cidrs`).
//! - **An unreachable API flushes nothing.** Errors only delay events; nothing is deleted because a
//!   list failed.
//! - **A relist is applied whole.** The objects of a relist (one after `410 Gone` or a failed watch) are
//!   compared with what was emitted as they arrive and only the differences are buffered; when the list
//!   is complete, the differences (changes, then deletions of whatever the list no longer has) go out as
//!   one batch, so the proxy loop never syncs half of it. A kind's first list goes out as it arrives
//!   instead, a page at a time: nothing is synced before `Synced` anyway, and the proxy loop stores one page
//!   while the next is read (a first list interrupted and started again deletes, when it completes, what
//!   the earlier attempt emitted and it no longer has).
//! - **Small memory.** Objects are converted to model types as they arrive and dropped; per object only
//!   a 64-bit fingerprint of what was emitted is kept (the proxy loop's store holds the model), and for the
//!   Services with external or LoadBalancer IPs their ports too (what closing them takes: see below).
//! - **Malformed objects are skipped** with their name and reason logged; the last good version of the
//!   object (if any) stays in effect, except where that would leave traffic flowing that neither version
//!   allows (`super::fail_closed`): a Service whose update or last good version has
//!   `loadBalancerSourceRanges` loses its external and LoadBalancer IPs until a usable version comes, and an
//!   EndpointSlice's endpoints are withdrawn.
//!
//! In parts: `slice_wire` is the lean EndpointSlice the watcher reads (only the fields the proxy uses), and
//! `service_wire` the Service (its metadata as lean);
//! `events` turns kube objects into what the coordinator takes; `coordinator` decides what to emit, with no
//! I/O; this module runs the watchers, on their runtime thread, and hands the batches over.

mod coordinator;
mod events;
mod lean;
mod recorder;
mod service_cidrs;
mod service_wire;
mod slice_wire;

use std::path::PathBuf;
use std::sync::mpsc;
use std::time::Duration;

use futures::{FutureExt, StreamExt};
use k8s_openapi::api::core::v1::Node;
use k8s_openapi::api::networking::v1::ServiceCIDR;
use kube::runtime::watcher;
use kube::runtime::WatchStreamExt;

pub use coordinator::{Coordinator, Kind};
use events::map_event;
pub use events::{
    node_info, parse_rfc3339, Converted, NodeError, TO_BE_DELETED_TAINT, TRIGGER_TIME_ANNOTATION,
};
use service_wire::WireService;
use slice_wire::WireSlice;

use super::backoff::{counting_client, Answered, WatchBackoff};
use super::Event;

/// kube-proxy's selector for Services and EndpointSlices: objects that another proxy implementation
/// claims, and headless services, are not its business.
pub(crate) const PROXY_LABEL_SELECTOR: &str =
    "!service.kubernetes.io/service-proxy-name,!service.kubernetes.io/headless";

/// How to reach the API server (kube-proxy's `--kubeconfig` / `--master`), and which node this is.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct KubeOptions {
    /// A kubeconfig file; its current context is used.
    pub kubeconfig: Option<PathBuf>,
    /// The API server's URL; overrides the kubeconfig's server. Without a kubeconfig: no credentials.
    pub master: Option<String>,
    /// This node's name: its Node object is watched (labels, addresses, pod CIDRs, deletion).
    pub node_name: String,
}

/// Watch errors per kind since start (exported as a metric).
pub static WATCH_ERRORS: [std::sync::atomic::AtomicU64; 4] =
    [const { std::sync::atomic::AtomicU64::new(0) }; 4];

/// The API source: watchers on a runtime thread, batches of events through a channel.
#[derive(Debug)]
pub struct KubeSource {
    rx: mpsc::Receiver<Vec<Event>>,
    notices: nftkube_model::Notices,
    stop: Option<futures::channel::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl KubeSource {
    /// Builds the client (reads the kubeconfig or the in-cluster service account; a configuration error
    /// is returned here) and starts watching. Does not wait for the API to answer.
    pub fn start(opts: KubeOptions) -> anyhow::Result<KubeSource> {
        KubeSource::start_notifying(opts, std::sync::Arc::new(|| {}))
    }

    /// [`KubeSource::start`], calling `notify` after each batch it queues.
    pub fn start_notifying(opts: KubeOptions, notify: super::Notify) -> anyhow::Result<KubeSource> {
        let (tx, rx) = super::Outbox::channel(notify);
        let (notices, notice_rx) = recorder::channel();
        let (ready_tx, ready_rx) = mpsc::channel::<Result<(), String>>();
        let (stop_tx, stop_rx) = futures::channel::oneshot::channel::<()>();
        let thread = std::thread::Builder::new()
            .name("kube-watch".into())
            .spawn(move || {
                let rt = match tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                {
                    Ok(rt) => rt,
                    Err(e) => {
                        let _ = ready_tx.send(Err(format!("starting the tokio runtime: {e}")));
                        return;
                    }
                };
                rt.block_on(async move {
                    let clients = config(&opts).await.and_then(|c| {
                        let events = kube::Client::try_from(c.clone())
                            .map_err(|e| format!("building the API client: {e}"))?;
                        Ok((Connections::new(&c)?, events))
                    });
                    let (connections, events) = match clients {
                        Ok(c) => c,
                        Err(e) => {
                            let _ = ready_tx.send(Err(e));
                            return;
                        }
                    };
                    let _ = ready_tx.send(Ok(()));
                    tokio::spawn(recorder::publish(events, opts.node_name.clone(), notice_rx));
                    let watch = run(connections, opts.node_name.clone(), tx).boxed();
                    futures::future::select(watch, stop_rx).await;
                });
            })?;
        match ready_rx.recv() {
            Ok(Ok(())) => Ok(KubeSource {
                rx,
                notices,
                stop: Some(stop_tx),
                thread: Some(thread),
            }),
            Ok(Err(e)) => {
                let _ = thread.join();
                Err(anyhow::anyhow!("{e}"))
            }
            Err(_) => {
                let _ = thread.join();
                Err(anyhow::anyhow!(
                    "the API watcher thread stopped during startup"
                ))
            }
        }
    }

    /// Where to send what should become a Kubernetes Event.
    pub fn notices(&self) -> nftkube_model::Notices {
        self.notices.clone()
    }

    /// Every batch received so far, in order.
    pub fn poll(&mut self) -> Vec<Event> {
        super::drain_batches(&self.rx)
    }
}

impl Drop for KubeSource {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(t) = self.thread.take() {
            // The runtime drops the watchers at once; bound the wait anyway (a connect in progress).
            super::join_within(t, Duration::from_secs(2));
        }
    }
}

/// The client configuration for `--kubeconfig` / `--master`, or the in-cluster service account.
async fn config(opts: &KubeOptions) -> Result<kube::Config, String> {
    let master = match opts.master.as_deref().filter(|m| !m.is_empty()) {
        Some(m) => Some(
            m.parse::<http::Uri>()
                .map_err(|e| format!("invalid --master {m:?}: {e}"))?,
        ),
        None => None,
    };
    let mut config = match (&opts.kubeconfig, &master) {
        (Some(path), _) => {
            let kc = kube::config::Kubeconfig::read_from(path)
                .map_err(|e| format!("reading kubeconfig {}: {e}", path.display()))?;
            kube::Config::from_custom_kubeconfig(kc, &kube::config::KubeConfigOptions::default())
                .await
                .map_err(|e| format!("kubeconfig {}: {e}", path.display()))?
        }
        (None, Some(url)) => kube::Config::new(url.clone()),
        (None, None) => kube::Config::incluster().map_err(|e| {
            format!("no --kubeconfig or --master, and no in-cluster configuration: {e}")
        })?,
    };
    if let Some(url) = master {
        config.cluster_url = url;
    }
    // Without a configured CA, kube builds its TLS setup from the system's trust store and fails where there is
    // none (an image holding only this binary), even for a plain-http server: give http an empty root store.
    if config.cluster_url.scheme_str() == Some("http") && config.root_cert.is_none() {
        config.root_cert = Some(Vec::new());
    }
    tracing::info!(server = %config.cluster_url, "watching the Kubernetes API");
    Ok(config)
}

/// A watcher's client and the backoff that the client's answers reset.
struct Connection {
    client: kube::Client,
    backoff: WatchBackoff,
}

impl Connection {
    fn new(config: &kube::Config) -> Result<Connection, String> {
        let answered = Answered::default();
        let client = counting_client(config.clone(), &answered)
            .map_err(|e| format!("building the API client: {e}"))?;
        Ok(Connection {
            client,
            backoff: WatchBackoff::new(answered),
        })
    }
}

/// One connection per watcher, so that each one's backoff follows its own requests.
struct Connections {
    services: Connection,
    slices: Connection,
    node: Connection,
    cidrs: Connection,
}

impl Connections {
    fn new(config: &kube::Config) -> Result<Connections, String> {
        Ok(Connections {
            services: Connection::new(config)?,
            slices: Connection::new(config)?,
            node: Connection::new(config)?,
            cidrs: Connection::new(config)?,
        })
    }
}

type Item = (Kind, Result<watcher::Event<Converted>, watcher::Error>);

/// Runs the watchers until the receiver goes away.
async fn run(connections: Connections, node_name: String, tx: super::Outbox) {
    let Connections {
        services,
        slices,
        node,
        cidrs,
    } = connections;
    let proxied = watcher::Config::default()
        .labels(PROXY_LABEL_SELECTOR)
        .any_semantic();
    let services = watcher::watcher(
        kube::Api::<WireService>::all(services.client),
        proxied.clone(),
    )
    .backoff(services.backoff)
    .map(|r| {
        let converted = r.map(|e| map_event(e, |s: &WireService| Converted::service(&s.0)));
        (Kind::Service, converted)
    })
    .boxed();
    // Read into the lean type, and converted with one set of shared values for the watcher's life (its
    // interners sweep what nobody holds any more).
    let mut shared = nftkube_model::SharedValues::default();
    let slices = watcher::watcher(kube::Api::<WireSlice>::all(slices.client), proxied)
        .backoff(slices.backoff)
        .map(move |r| {
            let converted = r.map(|e| map_event(e, |s| Converted::wire_slice(s, &mut shared)));
            (Kind::EndpointSlice, converted)
        })
        .boxed();
    // Every ServiceCIDR, as kube-proxy watches them: no selector.
    let cidrs = watcher::watcher(
        kube::Api::<ServiceCIDR>::all(cidrs.client),
        watcher::Config::default().any_semantic(),
    )
    .backoff(cidrs.backoff)
    .map(|r| {
        (
            Kind::ServiceCidr,
            r.map(|e| map_event(e, Converted::service_cidr)),
        )
    })
    .boxed();
    let mut streams: Vec<futures::stream::BoxStream<'static, Item>> = vec![services, slices, cidrs];
    if !node_name.is_empty() {
        let cfg = watcher::Config::default()
            .fields(&format!("metadata.name={node_name}"))
            .any_semantic();
        streams.push(
            watcher::watcher(kube::Api::<Node>::all(node.client), cfg)
                .backoff(node.backoff)
                .map(|r| (Kind::Node, r.map(|e| map_event(e, Converted::node))))
                .boxed(),
        );
    }
    // What is ready at once goes out as one batch: a first list's page (it is emitted as it arrives, see
    // the module documentation) wakes the proxy loop once, not once per object.
    let mut all = futures::stream::select_all(streams).ready_chunks(READY_ITEMS);
    let mut coordinator = Coordinator::default();
    let mut cidrs_failing = false;
    while let Some(items) = all.next().await {
        // Sized at once: an event is about a hundred bytes, and a batch grown a page at a time (a realloc
        // per doubling, the larger ones each consolidating glibc's free small chunks first) took a twentieth
        // of this thread at a million endpoints (perf).
        let mut batch = Vec::with_capacity(items.len());
        for (kind, item) in items {
            match item {
                Ok(ev) => {
                    // `Init` comes before the list is asked for (and fails again): not an answer yet.
                    let answered = !matches!(ev, watcher::Event::Init);
                    if kind == Kind::ServiceCidr && answered && std::mem::take(&mut cidrs_failing) {
                        tracing::info!("ServiceCIDRs can be read again");
                    }
                    batch.extend(coordinator.handle(kind, ev));
                }
                Err(e) => {
                    WATCH_ERRORS[kind as usize].fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    if kind == Kind::ServiceCidr {
                        service_cidrs_failed(&mut cidrs_failing, &e);
                    } else {
                        tracing::warn!(
                            kind = kind.as_str(),
                            "API watch failed (retrying with backoff; the programmed rules stay): {e}"
                        );
                    }
                }
            }
        }
        if !batch.is_empty() && tx.send(batch).is_err() {
            return;
        }
    }
}

/// A ServiceCIDR list or watch failed. Said once (at warning) until one succeeds again: on a cluster
/// without the resource (before 1.33) or without the right to list it, every retry fails the same way, and
/// nothing else waits for it.
fn service_cidrs_failed(failing: &mut bool, e: &watcher::Error) {
    if std::mem::replace(failing, true) {
        tracing::debug!("ServiceCIDR watch failed again: {e}");
    } else {
        tracing::warn!(
            "ServiceCIDRs cannot be listed or watched (absent before Kubernetes 1.33, or not allowed by the \
             ClusterRole): unallocated service addresses are dropped only in --service-cidr until they can \
             be; retrying with backoff, services and endpoints are not held back: {e}"
        );
    }
}

/// At most this many watcher items in one batch (two list pages of 500).
const READY_ITEMS: usize = 1000;

#[cfg(test)]
mod tests {
    use super::*;

    fn config_for(opts: &KubeOptions) -> Result<kube::Config, String> {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(config(opts))
    }

    /// `--master` alone: that server, no credentials; a plain-http one gets an empty root store, so that
    /// kube does not look for the system's (absent in an image holding only this binary).
    #[test]
    fn master_alone_is_the_server_and_plain_http_needs_no_trust_store() {
        let opts = KubeOptions {
            master: Some("http://127.0.0.1:8080".into()),
            ..KubeOptions::default()
        };
        let c = config_for(&opts).unwrap();
        assert_eq!(c.cluster_url.to_string(), "http://127.0.0.1:8080/");
        assert_eq!(c.root_cert, Some(Vec::new()));
        let https = KubeOptions {
            master: Some("https://127.0.0.1:6443".into()),
            ..KubeOptions::default()
        };
        assert_eq!(config_for(&https).unwrap().root_cert, None);
        let bad = KubeOptions {
            master: Some("http://[::1".into()),
            ..KubeOptions::default()
        };
        let e = config_for(&bad).unwrap_err();
        assert!(e.starts_with("invalid --master"), "{e}");
    }
}
