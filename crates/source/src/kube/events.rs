//! Kube objects as the coordinator takes them: a Service, an EndpointSlice, this Node or a ServiceCIDR converted to what
//! the model keeps (or to the reason it cannot be), with the key, the trigger time and the source-range
//! flag that the coordinator's decisions need. The k8s-openapi → model conversion itself is
//! [`crate::convert`]'s.

use std::time::SystemTime;

use k8s_openapi::api::core::v1::{Node, Service};
#[cfg(test)]
use k8s_openapi::api::discovery::v1::EndpointSlice;
use k8s_openapi::api::networking::v1::ServiceCIDR;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::runtime::watcher;

use super::slice_wire::WireSlice;
use crate::convert::{self, ServiceConversion, SliceConversion};
use crate::fail_closed::asks_source_ranges;
use crate::NodeInfo;
use nftkube_model::{parse_ip_sloppy, Cidr, NamespacedName, ServicePort, SharedValues, SliceInfo};

/// Annotation of an EndpointSlice: when the change that produced this version happened (RFC 3339).
pub const TRIGGER_TIME_ANNOTATION: &str = "endpoints.kubernetes.io/last-change-trigger-time";
/// The cluster autoscaler's taint on a node it is about to delete.
pub const TO_BE_DELETED_TAINT: &str = "ToBeDeletedByClusterAutoscaler";
const ZONE_LABEL: &str = "topology.kubernetes.io/zone";

/// An object converted to what the model keeps.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(super) enum Model {
    Service(Vec<ServicePort>),
    Slice(SliceInfo),
    Node(NodeInfo),
    /// A ServiceCIDR's `spec.cidrs` (merged with the other objects' by `super::service_cidrs`).
    ServiceCidr(Vec<Cidr>),
}

/// One object as a watcher delivered it: its identity, and its conversion (Ok(None): an object the proxy
/// ignores, such as a headless service; Err: malformed, with the reason).
pub struct Converted {
    pub(super) key: Option<NamespacedName>,
    pub(super) model: Result<Option<Model>, String>,
    pub(super) trigger: Option<SystemTime>,
    /// A Service whose spec lists `loadBalancerSourceRanges` (whether they convert or not).
    pub(super) restricts_sources: bool,
}

impl Converted {
    /// Converts a Service.
    pub fn service(svc: &Service) -> Converted {
        let key = meta_key(&svc.metadata);
        let model = match convert::service_ports(svc) {
            Ok(ServiceConversion::Ports(p)) => Ok(Some(Model::Service(p))),
            Ok(ServiceConversion::Skipped(reason)) => {
                tracing::debug!(service = ?key, reason, "service not proxied");
                Ok(None)
            }
            Err(e) => Err(e.reason),
        };
        Converted {
            key,
            model,
            trigger: None,
            restricts_sources: asks_source_ranges(svc),
        }
    }

    /// Converts an EndpointSlice read into k8s-openapi's type (the watcher reads [`WireSlice`]s; the
    /// coordinator's tests build these).
    #[cfg(test)]
    pub(crate) fn slice(slice: &EndpointSlice) -> Converted {
        Converted::slice_of(&slice.metadata, convert::endpoint_slice(slice))
    }

    /// Converts an EndpointSlice as the API watcher reads it, its namespace, port names and topologies
    /// shared with the slices converted before (the store keeps one copy of each anyway).
    pub(crate) fn wire_slice(slice: &WireSlice, shared: &mut SharedValues) -> Converted {
        let conversion = convert::slice_fields_sharing(&slice.fields(), shared);
        Converted::slice_of(&slice.metadata, conversion)
    }

    fn slice_of(
        meta: &ObjectMeta,
        conversion: Result<SliceConversion, convert::ConvertError>,
    ) -> Converted {
        let key = meta_key(meta);
        let model = match conversion {
            Ok(SliceConversion::Slice(s)) => Ok(Some(Model::Slice(s))),
            Ok(SliceConversion::Skipped(reason)) => {
                tracing::debug!(slice = ?key, reason, "EndpointSlice ignored");
                Ok(None)
            }
            Err(e) => Err(e.reason),
        };
        let trigger = meta
            .annotations
            .as_ref()
            .and_then(|a| a.get(TRIGGER_TIME_ANNOTATION))
            .and_then(|t| parse_rfc3339(t));
        Converted {
            key,
            model,
            trigger,
            restricts_sources: false,
        }
    }

    /// Converts this node's Node.
    pub fn node(node: &Node) -> Converted {
        Converted {
            key: meta_key(&node.metadata),
            model: node_info(node)
                .map(|n| Some(Model::Node(n)))
                .map_err(|e| e.to_string()),
            trigger: None,
            restricts_sources: false,
        }
    }
}

impl Converted {
    /// Converts a ServiceCIDR: its `spec.cidrs`, whatever its status says. kube-proxy too takes every
    /// object's CIDRs, one being deleted (a deletion timestamp, held by a finalizer while Services still use
    /// it) included, until the object is gone.
    pub(crate) fn service_cidr(object: &ServiceCIDR) -> Converted {
        let texts = object.spec.as_ref().and_then(|s| s.cidrs.as_ref());
        let cidrs = texts
            .into_iter()
            .flatten()
            .enumerate()
            .map(|(i, text)| {
                text.parse::<Cidr>()
                    .map_err(|e| format!("spec.cidrs[{i}] {text:?}: {e}"))
            })
            .collect::<Result<Vec<_>, _>>();
        Converted {
            key: meta_key(&object.metadata),
            model: cidrs.map(|c| Some(Model::ServiceCidr(c))),
            trigger: None,
            restricts_sources: false,
        }
    }
}

/// "namespace/name" of an object (namespace "" for cluster-scoped ones); None without a name.
fn meta_key(meta: &ObjectMeta) -> Option<NamespacedName> {
    let name = meta.name.as_deref().filter(|n| !n.is_empty())?;
    Some(NamespacedName::new(
        meta.namespace.clone().unwrap_or_default(),
        name,
    ))
}

/// An RFC 3339 timestamp (what the API writes in annotations) as a system time.
pub fn parse_rfc3339(s: &str) -> Option<SystemTime> {
    let ts: k8s_openapi::jiff::Timestamp = s.trim().parse().ok()?;
    Some(SystemTime::from(ts))
}

/// A Node object nftkube cannot use.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NodeError {
    /// A pod CIDR that does not parse.
    #[error("node {node}: spec.podCIDRs: {source}")]
    PodCidr {
        /// The Node's name.
        node: String,
        /// What is wrong with the CIDR.
        source: nftkube_model::ParseError,
    },
}

/// Converts this node's object.
pub fn node_info(node: &Node) -> Result<NodeInfo, NodeError> {
    let name = node.metadata.name.clone().unwrap_or_default();
    let zone = node
        .metadata
        .labels
        .as_ref()
        .and_then(|l| l.get(ZONE_LABEL))
        .cloned();
    let listed = node
        .status
        .as_ref()
        .and_then(|s| s.addresses.as_ref())
        .map(Vec::as_slice)
        .unwrap_or_default();
    // Every InternalIP before any ExternalIP, as kube-proxy's GetNodeHostIPs orders them: the first of each
    // family is the node's primary IP.
    let mut addresses = Vec::new();
    for kind in ["InternalIP", "ExternalIP"] {
        for a in listed.iter().filter(|a| a.type_ == kind) {
            // Read as kube-proxy reads node addresses (ParseIPSloppy), so both pick the same node IPs.
            match parse_ip_sloppy(&a.address) {
                Some(ip) if !addresses.contains(&ip) => addresses.push(ip),
                Some(_) => {}
                None => {
                    tracing::debug!(address = a.address, "ignoring a node address that is no IP")
                }
            }
        }
    }
    let spec = node.spec.as_ref();
    let cidr_strings: Vec<&String> = match spec.and_then(|s| s.pod_cidrs.as_ref()) {
        Some(c) if !c.is_empty() => c.iter().collect(),
        _ => spec.and_then(|s| s.pod_cidr.as_ref()).into_iter().collect(),
    };
    let pod_cidrs = cidr_strings
        .into_iter()
        .filter(|s| !s.is_empty())
        .map(|s| {
            s.parse::<Cidr>().map_err(|source| NodeError::PodCidr {
                node: name.clone(),
                source,
            })
        })
        .collect::<Result<Vec<_>, _>>()?;
    let tainted = spec
        .and_then(|s| s.taints.as_ref())
        .is_some_and(|t| t.iter().any(|t| t.key == TO_BE_DELETED_TAINT));
    Ok(NodeInfo {
        name,
        zone,
        addresses,
        pod_cidrs,
        deleting: node.metadata.deletion_timestamp.is_some() || tainted,
    })
}

pub(super) fn map_event<K>(
    ev: watcher::Event<K>,
    mut f: impl FnMut(&K) -> Converted,
) -> watcher::Event<Converted> {
    match ev {
        watcher::Event::Apply(o) => watcher::Event::Apply(f(&o)),
        watcher::Event::Delete(o) => watcher::Event::Delete(f(&o)),
        watcher::Event::Init => watcher::Event::Init,
        watcher::Event::InitApply(o) => watcher::Event::InitApply(f(&o)),
        watcher::Event::InitDone => watcher::Event::InitDone,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn node_info_reads_zone_addresses_cidrs_and_deletion() {
        let node: Node = serde_json::from_value(serde_json::json!({
            "metadata": {"name": "node-1", "labels": {"topology.kubernetes.io/zone": "z1"}},
            "spec": {"podCIDRs": ["10.244.1.0/24", "fd00:244:1::/64"],
                     "taints": [{"key": "ToBeDeletedByClusterAutoscaler", "effect": "NoSchedule"}]},
            "status": {"addresses": [{"type": "Hostname", "address": "node-1"},
                                     {"type": "ExternalIP", "address": "203.0.113.10"},
                                     {"type": "InternalIP", "address": "192.168.1.10"},
                                     {"type": "InternalIP", "address": "fd00::10"}]},
        }))
        .unwrap();
        let n = node_info(&node).unwrap();
        assert_eq!(n.name, "node-1");
        assert_eq!(n.zone.as_deref(), Some("z1"));
        // InternalIPs first, though the ExternalIP is listed before them: the first IPv4 is the primary one.
        let listed: Vec<String> = n.addresses.iter().map(ToString::to_string).collect();
        assert_eq!(listed, ["192.168.1.10", "fd00::10", "203.0.113.10"]);
        assert_eq!(n.pod_cidrs[0].to_string(), "10.244.1.0/24");
        assert!(n.deleting);
        let mut bad = node.clone();
        bad.spec.as_mut().unwrap().pod_cidrs = Some(vec!["10.244.1.0/99".into()]);
        assert!(node_info(&bad)
            .unwrap_err()
            .to_string()
            .contains("podCIDRs"));
    }
}
