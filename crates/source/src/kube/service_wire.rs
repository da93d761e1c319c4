//! A Service as the API watcher reads it: k8s-openapi's `Service`, but its metadata read as the lean
//! EndpointSlice's is ([`super::lean::lean_meta`]: name, namespace, labels, annotations,
//! resourceVersion and creationTimestamp). The API server sends every object with its `managedFields`, which
//! k8s-openapi's type builds into a vector of entries, each with a JSON tree: for a Service that is often
//! more than the spec and status together, and the proxy never reads it. The spec and status keep
//! k8s-openapi's types, so the conversion ([`crate::convert::service_ports`]) and its checks are the ones
//! the manifests' Services go through.

use k8s_openapi::api::core::v1::{Service, ServiceSpec, ServiceStatus};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use serde::{Deserialize, Deserializer};

use super::lean::{lean_meta, resource_as};

/// core/v1 Service, read for the proxy; `.0` is what the conversion takes.
#[derive(Debug, Clone)]
pub(crate) struct WireService(pub(crate) Service);

/// The fields a [`WireService`] is read from.
#[derive(Deserialize)]
struct Fields {
    #[serde(default, deserialize_with = "lean_meta")]
    metadata: ObjectMeta,
    spec: Option<ServiceSpec>,
    status: Option<ServiceStatus>,
}

impl<'de> Deserialize<'de> for WireService {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let f = Fields::deserialize(d)?;
        Ok(WireService(Service {
            metadata: f.metadata,
            spec: f.spec,
            status: f.status,
        }))
    }
}

resource_as!(WireService, Service, 0.metadata);

#[cfg(test)]
mod tests {
    use super::*;
    use crate::convert::service_ports;
    use serde_json::json;

    fn service() -> serde_json::Value {
        json!({
            "apiVersion": "v1", "kind": "Service",
            "metadata": {"name": "web", "namespace": "ns", "resourceVersion": "9", "uid": "u",
                         "creationTimestamp": "2024-01-01T00:00:00Z",
                         "labels": {"app": "web"},
                         "annotations": {"note": "x"},
                         "managedFields": [{"manager": "kubectl", "operation": "Apply",
                                            "fieldsType": "FieldsV1",
                                            "fieldsV1": {"f:spec": {"f:ports": {}}}}]},
            "spec": {"type": "LoadBalancer", "clusterIP": "10.96.0.10", "clusterIPs": ["10.96.0.10"],
                     "ports": [{"name": "http", "port": 80, "targetPort": 8080, "protocol": "TCP",
                                "nodePort": 30080}],
                     "externalIPs": ["192.0.2.7"], "sessionAffinity": "ClientIP",
                     "externalTrafficPolicy": "Local", "healthCheckNodePort": 31000,
                     "loadBalancerSourceRanges": ["198.51.100.0/24"]},
            "status": {"loadBalancer": {"ingress": [{"ip": "203.0.113.5"}]}},
        })
    }

    /// The same JSON through k8s-openapi's type and through the lean one: the same conversion, and the
    /// metadata the watcher and the conversion read.
    #[test]
    fn converts_as_the_full_type_does() {
        let full: Service = serde_json::from_value(service()).unwrap();
        let lean: WireService = serde_json::from_value(service()).unwrap();
        assert_eq!(
            format!("{:?}", service_ports(&lean.0)),
            format!("{:?}", service_ports(&full))
        );
        assert!(service_ports(&lean.0).is_ok());
        assert_eq!(lean.0.spec, full.spec);
        assert_eq!(lean.0.status, full.status);
        let m = &lean.0.metadata;
        assert_eq!(m.resource_version.as_deref(), Some("9"));
        assert_eq!(m.creation_timestamp, full.metadata.creation_timestamp);
        assert_eq!(m.labels, full.metadata.labels);
        assert_eq!(m.annotations, full.metadata.annotations);
        assert!(m.managed_fields.is_none() && full.metadata.managed_fields.is_some());
    }

    /// A malformed Service is refused with the same words, and a field of the wrong type fails the read as
    /// it fails k8s-openapi's.
    #[test]
    fn refuses_what_the_full_type_refuses() {
        let mut bad = service();
        bad["spec"]["clusterIPs"] = json!(["10.96.0.10", "nope"]);
        let full: Service = serde_json::from_value(bad.clone()).unwrap();
        let lean: WireService = serde_json::from_value(bad).unwrap();
        let (want, got) = (service_ports(&full), service_ports(&lean.0));
        assert!(got.is_err());
        assert_eq!(format!("{got:?}"), format!("{want:?}"));
        let mut wrong = service();
        wrong["spec"]["ports"] = json!("80");
        assert!(serde_json::from_value::<Service>(wrong.clone()).is_err());
        assert!(serde_json::from_value::<WireService>(wrong).is_err());
        let mut no_meta = service();
        no_meta["metadata"] = json!(null);
        let lean: WireService = serde_json::from_value(no_meta).unwrap();
        assert!(service_ports(&lean.0).is_err());
    }
}
