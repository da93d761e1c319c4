//! What an operator must see without reading the agent's log, as kube-proxy tells it: a Kubernetes Event
//! on this Node or on a Service. The API source publishes them; without the API they are only logged.

use std::sync::Arc;

use super::NamespacedName;

/// One event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Notice {
    /// What it is about.
    pub about: About,
    /// A warning (else a normal event).
    pub warning: bool,
    /// The reason, in PascalCase, as kube-proxy names it (`Starting`, `FailedToStartServiceHealthcheck`).
    pub reason: &'static str,
    /// The action it concerns (`StartKubeProxy`, `Listen`).
    pub action: &'static str,
    /// The human-readable detail.
    pub note: String,
}

/// The object an event is attached to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum About {
    /// This node's Node object.
    Node,
    /// A Service.
    Service(NamespacedName),
}

/// Where notices go; sending never blocks (a publisher that falls behind drops them).
#[derive(Clone)]
pub struct Notices(Arc<dyn Fn(Notice) + Send + Sync>);

impl Notices {
    /// Notices handed to `publish`.
    pub fn new(publish: impl Fn(Notice) + Send + Sync + 'static) -> Notices {
        Notices(Arc::new(publish))
    }

    /// Notices that go nowhere (no API to publish them to).
    pub fn none() -> Notices {
        Notices::new(|_| {})
    }

    /// Sends one (never blocks).
    pub fn send(&self, notice: Notice) {
        (self.0)(notice)
    }
}

impl Default for Notices {
    fn default() -> Self {
        Notices::none()
    }
}

impl std::fmt::Debug for Notices {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Notices")
    }
}
