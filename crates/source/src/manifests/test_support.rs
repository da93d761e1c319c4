//! What the manifest source's tests share: a temporary directory written as editors and ConfigMap updates
//! write, manifests of a Service and an EndpointSlice, and a short rendering of events.

use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::SystemTime;

use crate::Event;

/// A temporary directory removed on drop.
pub(super) struct TempDir(pub(super) PathBuf);

impl TempDir {
    pub(super) fn new(tag: &str) -> TempDir {
        static N: AtomicUsize = AtomicUsize::new(0);
        let nanos = SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .unwrap()
            .as_nanos();
        let dir = std::env::temp_dir().join(format!(
            "nftkube-manifests-{tag}-{}-{}-{nanos}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir_all(&dir).unwrap();
        TempDir(dir)
    }

    /// Writes through a temporary file and a rename, as editors and ConfigMap updates do (a new
    /// inode, so the change is seen even within one mtime tick).
    pub(super) fn write(&self, name: &str, content: &str) -> PathBuf {
        let tmp = self.0.join(format!(".tmp-{name}"));
        std::fs::write(&tmp, content).unwrap();
        let path = self.0.join(name);
        std::fs::rename(&tmp, &path).unwrap();
        path
    }

    pub(super) fn remove(&self, name: &str) {
        std::fs::remove_file(self.0.join(name)).unwrap();
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

pub(super) fn service(name: &str, ip: &str) -> String {
    format!(
        "apiVersion: v1\nkind: Service\nmetadata:\n  name: {name}\n  namespace: demo\n\
         spec:\n  clusterIP: {ip}\n  ports:\n  - name: tcp\n    port: 80\n    targetPort: 8080\n"
    )
}

pub(super) fn slice(name: &str, svc: &str, ips: &[&str]) -> String {
    let mut s = format!(
        "apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata:\n  name: {name}\n  namespace: demo\n  \
         labels:\n    kubernetes.io/service-name: {svc}\naddressType: IPv4\nports:\n- name: tcp\n  port: 8080\n  \
         protocol: TCP\nendpoints:\n"
    );
    for ip in ips {
        s.push_str(&format!(
            "- addresses: [\"{ip}\"]\n  conditions: {{ready: true}}\n"
        ));
    }
    s
}

/// A short rendering of events for assertions.
pub(super) fn names(events: &[Event]) -> Vec<String> {
    events
        .iter()
        .map(|e| match e {
            Event::ServiceApplied { key, ports } => {
                format!("svc+ {key} ({} ports)", ports.len())
            }
            Event::ServiceDeleted(key) => format!("svc- {key}"),
            Event::SliceApplied(s) => format!(
                "slice+ {}/{} ({} eps)",
                s.namespace,
                s.name,
                s.endpoints.len()
            ),
            Event::SliceDeleted { namespace, name } => format!("slice- {namespace}/{name}"),
            Event::Synced => "synced".into(),
            other => format!("{other:?}"),
        })
        .collect()
}
