//! What the API watcher's lean types ([`super::slice_wire::WireSlice`], [`super::service_wire::WireService`])
//! share: their metadata, read without what the proxy never uses, and their `kube::Resource` identity, taken
//! from the k8s-openapi type they stand for.

use std::collections::BTreeMap;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time};
use serde::{Deserialize, Deserializer};

/// The metadata the watcher's lean types keep; `managedFields`, often the
/// larger part of an object the API server sends, is skipped unread.
#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct LeanMeta {
    name: Option<String>,
    namespace: Option<String>,
    labels: Option<BTreeMap<String, String>>,
    annotations: Option<BTreeMap<String, String>>,
    resource_version: Option<String>,
    /// Ranks Services claiming one frontend (a slice's is read and not used: one timestamp).
    creation_timestamp: Option<Time>,
}

/// A field that is absent or `null` reads as its default, as k8s-openapi reads every one of these.
pub(super) fn null_as_default<'de, D: Deserializer<'de>, T: Deserialize<'de> + Default>(
    d: D,
) -> Result<T, D::Error> {
    Ok(Option::<T>::deserialize(d)?.unwrap_or_default())
}

pub(super) fn lean_meta<'de, D: Deserializer<'de>>(d: D) -> Result<ObjectMeta, D::Error> {
    let Some(m) = Option::<LeanMeta>::deserialize(d)? else {
        return Ok(ObjectMeta::default());
    };
    Ok(ObjectMeta {
        name: m.name,
        namespace: m.namespace,
        labels: m.labels,
        annotations: m.annotations,
        resource_version: m.resource_version,
        creation_timestamp: m.creation_timestamp,
        ..ObjectMeta::default()
    })
}

/// `kube::Resource` for a lean type `$wire` that stands for the k8s-openapi type `$full` (kind, group,
/// version, plural and scope are `$full`'s), its metadata at `self.$meta`.
macro_rules! resource_as {
    ($wire:ty, $full:ty, $($meta:tt)+) => {
        impl kube::Resource for $wire {
            type DynamicType = ();
            type Scope = <$full as kube::Resource>::Scope;

            fn kind(dt: &()) -> std::borrow::Cow<'_, str> {
                <$full as kube::Resource>::kind(dt)
            }
            fn group(dt: &()) -> std::borrow::Cow<'_, str> {
                <$full as kube::Resource>::group(dt)
            }
            fn version(dt: &()) -> std::borrow::Cow<'_, str> {
                <$full as kube::Resource>::version(dt)
            }
            fn plural(dt: &()) -> std::borrow::Cow<'_, str> {
                <$full as kube::Resource>::plural(dt)
            }
            fn meta(&self) -> &ObjectMeta {
                &self.$($meta)+
            }
            fn meta_mut(&mut self) -> &mut ObjectMeta {
                &mut self.$($meta)+
            }
        }
    };
}
pub(super) use resource_as;

#[cfg(test)]
mod tests {
    use super::super::{service_wire::WireService, slice_wire::WireSlice};
    use k8s_openapi::api::core::v1::Service;
    use k8s_openapi::api::discovery::v1::EndpointSlice;
    use kube::Resource;

    /// The watcher asks the API server for the lean types at the full types' paths.
    #[test]
    fn lean_types_are_listed_where_the_full_types_are() {
        assert_eq!(
            WireService::url_path(&(), Some("ns")),
            "/api/v1/namespaces/ns/services"
        );
        assert_eq!(
            WireService::url_path(&(), None),
            Service::url_path(&(), None)
        );
        assert_eq!(
            WireSlice::url_path(&(), None),
            "/apis/discovery.k8s.io/v1/endpointslices"
        );
        assert_eq!(
            WireSlice::url_path(&(), Some("ns")),
            EndpointSlice::url_path(&(), Some("ns"))
        );
        assert_eq!(WireService::kind(&()), "Service");
        assert_eq!(WireSlice::api_version(&()), "discovery.k8s.io/v1");
    }
}
