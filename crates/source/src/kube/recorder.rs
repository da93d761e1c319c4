//! Publishes [`Notice`]s as Kubernetes Events (events.k8s.io/v1), as kube-proxy's event recorder does:
//! reported by `nftkube` from this node, about the Node (by name; its uid is the name too, as kube-proxy
//! sets it) or a Service. kube-rs' recorder folds a repeat of the same event within minutes into a series.
//!
//! Publishing is the API's pace, never the agent's: notices queue in a small bounded channel, and one that
//! finds it full is dropped (and logged at debug: the agent's log has each of them already).

use k8s_openapi::api::core::v1::ObjectReference;
use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use nftkube_model::{About, Notice, Notices};
use tokio::sync::mpsc;

/// Notices waiting to be published, at most.
const QUEUE: usize = 64;

/// The sending side (what the agent's parts are given) and the receiving side (for [`publish`]).
pub(crate) fn channel() -> (Notices, mpsc::Receiver<Notice>) {
    let (tx, rx) = mpsc::channel(QUEUE);
    let notices = Notices::new(move |n: Notice| {
        if let Err(e) = tx.try_send(n) {
            tracing::debug!("event not published (the queue is full or closed): {e}");
        }
    });
    (notices, rx)
}

/// Publishes every notice `rx` yields until it closes. A failed publication is logged (at warn the first
/// time: most often the ClusterRole lacks `create` on events) and does not stop the next ones.
pub(crate) async fn publish(client: kube::Client, node: String, mut rx: mpsc::Receiver<Notice>) {
    let reporter = Reporter {
        controller: "nftkube".into(),
        instance: Some(node.clone()),
    };
    let recorder = Recorder::new(client, reporter);
    let mut failed_before = false;
    while let Some(notice) = rx.recv().await {
        let event = Event {
            type_: match notice.warning {
                true => EventType::Warning,
                false => EventType::Normal,
            },
            reason: notice.reason.into(),
            note: Some(notice.note.clone()),
            action: notice.action.into(),
            secondary: None,
        };
        if let Err(e) = recorder
            .publish(&event, &reference(&node, &notice.about))
            .await
        {
            match std::mem::replace(&mut failed_before, true) {
                false => tracing::warn!(reason = notice.reason, "cannot publish an event: {e}"),
                true => tracing::debug!(reason = notice.reason, "cannot publish an event: {e}"),
            }
        }
    }
}

/// The object an event is about.
fn reference(node: &str, about: &About) -> ObjectReference {
    match about {
        About::Node => ObjectReference {
            api_version: Some("v1".into()),
            kind: Some("Node".into()),
            name: Some(node.into()),
            uid: Some(node.into()),
            ..ObjectReference::default()
        },
        About::Service(name) => ObjectReference {
            api_version: Some("v1".into()),
            kind: Some("Service".into()),
            namespace: Some(name.namespace.to_string()),
            name: Some(name.name.to_string()),
            ..ObjectReference::default()
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn events_name_the_node_as_kube_proxy_does_and_a_full_queue_drops() {
        let node = reference("node-1", &About::Node);
        assert_eq!(node.kind.as_deref(), Some("Node"));
        assert_eq!(node.uid.as_deref(), Some("node-1"));
        assert_eq!(node.namespace, None);
        let svc = reference(
            "node-1",
            &About::Service(nftkube_model::NamespacedName::new("ns", "web")),
        );
        assert_eq!(
            (svc.namespace.as_deref(), svc.name.as_deref()),
            (Some("ns"), Some("web"))
        );
        let (notices, mut rx) = channel();
        let notice = Notice {
            about: About::Node,
            warning: false,
            reason: "Starting",
            action: "StartKubeProxy",
            note: String::new(),
        };
        for _ in 0..QUEUE + 10 {
            notices.send(notice.clone());
        }
        let mut queued = 0;
        while rx.try_recv().is_ok() {
            queued += 1;
        }
        assert_eq!(
            queued, QUEUE,
            "sending never blocks; the surplus is dropped"
        );
    }
}
