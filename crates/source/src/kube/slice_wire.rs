//! An EndpointSlice as the API watcher reads it: only the fields the proxy uses, so that a first list of a
//! million endpoints is not first built as k8s-openapi's `EndpointSlice` and then converted.
//!
//! k8s-openapi's `Endpoint` is about 340 bytes (its `targetRef`, hostname, deprecated topology...), so a
//! slice's endpoints grow a vector of large allocations, each of which made glibc consolidate the small
//! chunks freed before: perf put malloc, free, their consolidation and the moves at half of the watcher
//! thread's time at a million endpoints. Here an endpoint holds what the conversion reads, and what the
//! proxy never reads (`targetRef`, `hostname`, `metadata.managedFields`, ...) is skipped by the JSON
//! reader without being allocated. The conversion and its checks are the same as for a slice read from
//! manifests ([`crate::convert::slice_fields_sharing`]), and a field of the wrong type still fails the page
//! as it did with k8s-openapi's types.

use k8s_openapi::api::discovery::v1::{
    EndpointConditions, EndpointHints, EndpointPort, EndpointSlice,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use serde::Deserialize;

use super::lean::{lean_meta, null_as_default, resource_as};

use crate::convert::{self, EndpointFields, SliceFields};
use nftkube_model::Topology;

/// discovery.k8s.io/v1 EndpointSlice, read for the proxy.
#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct WireSlice {
    /// Name, namespace, labels, annotations and resourceVersion (what the watcher and the conversion read).
    #[serde(default, deserialize_with = "lean_meta")]
    pub(crate) metadata: ObjectMeta,
    #[serde(default, deserialize_with = "null_as_default")]
    pub(crate) address_type: String,
    /// Go writes a slice without endpoints as `"endpoints": null`.
    #[serde(default, deserialize_with = "null_as_default")]
    pub(crate) endpoints: Vec<WireEndpoint>,
    pub(crate) ports: Option<Vec<EndpointPort>>,
}

/// One endpoint of a [`WireSlice`].
#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct WireEndpoint {
    #[serde(default, deserialize_with = "null_as_default")]
    pub(crate) addresses: Vec<String>,
    pub(crate) conditions: Option<EndpointConditions>,
    pub(crate) node_name: Option<String>,
    pub(crate) zone: Option<String>,
    /// Boxed: rare, and the endpoint stays small without it.
    pub(crate) hints: Option<Box<EndpointHints>>,
}

impl WireSlice {
    /// The fields the conversion reads.
    pub(crate) fn fields(&self) -> SliceFields<'_, WireEndpoint> {
        SliceFields {
            metadata: &self.metadata,
            address_type: &self.address_type,
            ports: self.ports.as_deref(),
            endpoints: &self.endpoints,
        }
    }
}

impl EndpointFields for WireEndpoint {
    fn addresses(&self) -> &[String] {
        &self.addresses
    }
    fn conditions(&self) -> Option<&EndpointConditions> {
        self.conditions.as_ref()
    }
    fn topology(&self) -> Topology {
        convert::topology(
            self.node_name.as_ref(),
            self.zone.as_ref(),
            self.hints.as_deref(),
        )
    }
}

resource_as!(WireSlice, EndpointSlice, metadata);

#[cfg(test)]
mod tests {
    use super::*;
    use crate::convert::{endpoint_slice, SliceConversion};
    use k8s_openapi::api::discovery::v1::EndpointSlice;
    use nftkube_model::SharedValues;
    use serde_json::json;

    /// The same JSON through k8s-openapi's type and through the lean one: the same conversion, or the same
    /// error (reason and object).
    fn both(object: serde_json::Value) -> Result<SliceConversion, String> {
        let full: EndpointSlice = serde_json::from_value(object.clone()).unwrap();
        let lean: WireSlice = serde_json::from_value(object).unwrap();
        let want = endpoint_slice(&full).map_err(|e| e.to_string());
        let got = convert::slice_fields_sharing(&lean.fields(), &mut SharedValues::default())
            .map_err(|e| e.to_string());
        assert_eq!(got, want);
        got
    }

    fn slice(endpoints: serde_json::Value) -> serde_json::Value {
        json!({
            "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
            "metadata": {"name": "web-x", "namespace": "ns", "resourceVersion": "7", "uid": "u",
                         "labels": {"kubernetes.io/service-name": "web", "other": "x"},
                         "annotations": {"endpoints.kubernetes.io/last-change-trigger-time": "2024-01-01T00:00:00Z"},
                         "managedFields": [{"manager": "kube-controller-manager", "operation": "Update",
                                            "fieldsType": "FieldsV1", "fieldsV1": {"f:endpoints": {}}}]},
            "addressType": "IPv4",
            "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}, {"name": "all"}],
            "endpoints": endpoints,
        })
    }

    #[test]
    fn reads_and_converts_as_the_full_type_does() {
        let got = both(slice(json!([
            {"addresses": ["10.0.0.1", "10.0.0.9"], "conditions": {"ready": true}, "nodeName": "n1",
             "targetRef": {"kind": "Pod", "name": "web-1", "namespace": "ns", "uid": "p1"},
             "hostname": "web-1", "deprecatedTopology": {"a": "b"}},
            {"addresses": ["10.0.0.2"], "conditions": {"ready": false, "serving": true, "terminating": true},
             "zone": "z1", "hints": {"forZones": [{"name": "z1"}], "forNodes": [{"name": "n2"}]}},
            {"addresses": []},
            {"addresses": ["010.000.000.003"]},
        ])))
        .unwrap();
        let SliceConversion::Slice(info) = got else {
            panic!("skipped")
        };
        assert_eq!(info.endpoints.len(), 3);
        assert_eq!(info.endpoints[1].zone_hints(), ["z1".to_string()]);
        let lean: WireSlice = serde_json::from_value(slice(json!([]))).unwrap();
        assert_eq!(lean.metadata.resource_version.as_deref(), Some("7"));
        assert!(lean
            .metadata
            .annotations
            .unwrap()
            .contains_key(crate::kube::TRIGGER_TIME_ANNOTATION));
    }

    #[test]
    fn refuses_what_the_full_type_refuses_with_the_same_words() {
        let bad_address = both(slice(
            json!([{"addresses": ["10.0.0.1"]}, {"addresses": ["nope"]}]),
        ));
        assert!(bad_address.unwrap_err().contains("endpoints[1]"));
        let wrong_family = both(slice(json!([{"addresses": ["fd00::1"]}])));
        assert!(wrong_family
            .unwrap_err()
            .contains("does not match addressType"));
        let mut unnamed = slice(json!([]));
        unnamed["metadata"]["name"] = json!("Not_A_Name");
        assert!(both(unnamed).is_err());
        let mut fqdn = slice(json!([]));
        fqdn["addressType"] = json!("FQDN");
        assert!(matches!(both(fqdn), Ok(SliceConversion::Skipped(_))));
    }

    /// `null` and absent fields read as k8s-openapi reads them: Go writes a slice without endpoints as
    /// `"endpoints": null`, and such a slice must not fail its page.
    #[test]
    fn null_and_absent_fields_read_as_their_defaults() {
        let got = both(slice(json!(null))).unwrap();
        assert!(matches!(got, SliceConversion::Slice(s) if s.endpoints.is_empty()));
        let mut absent = slice(json!([{"addresses": null}, {"addresses": ["10.0.0.1"]}]));
        absent.as_object_mut().unwrap().remove("ports");
        absent["metadata"]["annotations"] = json!(null);
        let SliceConversion::Slice(s) = both(absent).unwrap() else {
            panic!("skipped")
        };
        assert_eq!(s.endpoints.len(), 1);
        // No metadata or addressType at all: refused for the same reason by both.
        assert!(both(json!({"endpoints": []})).is_err());
        assert!(both(json!({"metadata": null, "addressType": null})).is_err());
    }

    /// A field of the wrong type fails the read, as k8s-openapi's type does (the API server never sends one).
    #[test]
    fn a_field_of_the_wrong_type_fails_both_reads() {
        let mut wrong = slice(json!([{"addresses": "10.0.0.1"}]));
        assert!(serde_json::from_value::<EndpointSlice>(wrong.clone()).is_err());
        assert!(serde_json::from_value::<WireSlice>(wrong.clone()).is_err());
        wrong["endpoints"] = json!([]);
        wrong["metadata"]["labels"] = json!(["x"]);
        assert!(serde_json::from_value::<EndpointSlice>(wrong.clone()).is_err());
        assert!(serde_json::from_value::<WireSlice>(wrong).is_err());
    }
}
