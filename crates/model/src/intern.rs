//! Sharing of values that many objects repeat (namespaces, port names, an endpoint's node and zone), and
//! map keys made of shared strings that can still be queried with a borrowed `NamespacedName`.
//!
//! At 50k services a per-object copy of each repeated string costs tens of megabytes; one `Arc` per distinct
//! value costs a pointer per use.

use std::borrow::Borrow;
use std::collections::HashSet;
use std::hash::{Hash, Hasher};
use std::sync::Arc;

use super::types::NamespacedName;

/// Where an endpoint runs and which topology hints it carries. Endpoints of one node usually have the same
/// values, so the store keeps one shared copy per distinct value (see [`Interner`]).
#[derive(Debug, Clone, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Topology {
    /// The node the endpoint is on.
    pub node_name: Option<String>,
    /// The zone the endpoint is in.
    pub zone: Option<String>,
    /// Topology hints: zones this endpoint should serve ("forZones").
    pub zone_hints: Vec<String>,
    /// Topology hints: nodes this endpoint should serve ("forNodes").
    pub node_hints: Vec<String>,
}

impl Topology {
    /// True when there is nothing to keep: such endpoints store no topology at all.
    pub fn is_empty(&self) -> bool {
        *self == Topology::default()
    }
}

/// The hash maps looked up for every object a source reads or the store applies: foldhash, as the
/// interners below, not the std hasher's SipHash. Their hashes only find candidates, which are compared
/// whole.
pub type FastMap<K, V> = std::collections::HashMap<K, V, foldhash::fast::RandomState>;
/// [`FastMap`]'s set.
pub type FastSet<T> = HashSet<T, foldhash::fast::RandomState>;

/// A set of shared values: equal values come back as the same `Arc`.
///
/// Values nobody else holds any more are dropped when the set has doubled since the last sweep, so the
/// set stays within twice the live values (plus a small floor) at amortised O(1) per insertion.
///
/// Hashed with foldhash, not the std hasher's SipHash: every endpoint's topology is looked up here at
/// least once on its way into the store (from the API twice, the watcher's conversion and the store, and a
/// third time in a held-back relist). From the API at a million endpoints the cold sync took 0.25–0.3 s less (two
/// interleaved pairs of runs). A hash here only finds candidates, which are compared whole, so its
/// strength decides no result; foldhash is seeded per process, like the std hasher.
#[derive(Debug)]
pub struct Interner<T: ?Sized + Eq + Hash> {
    set: HashSet<Arc<T>, foldhash::fast::RandomState>,
    /// Size after the last sweep: the next sweep runs at twice this.
    swept_len: usize,
}

impl<T: ?Sized + Eq + Hash> Default for Interner<T> {
    fn default() -> Self {
        Interner {
            set: HashSet::default(),
            swept_len: 0,
        }
    }
}

/// Below this many values a sweep is not worth its pass over the set.
const SWEEP_FLOOR: usize = 64;

impl<T: ?Sized + Eq + Hash> Interner<T> {
    /// The shared copy of `value`, adopting `value` itself if there is none yet.
    pub(crate) fn share(&mut self, value: &Arc<T>) -> Arc<T> {
        if let Some(shared) = self.set.get(&**value) {
            return shared.clone();
        }
        self.insert(value.clone())
    }

    /// The shared copy of `value`, made by `make` if there is none yet.
    pub(crate) fn get_or_make(&mut self, value: &T, make: impl FnOnce(&T) -> Arc<T>) -> Arc<T> {
        match self.set.get(value) {
            Some(shared) => shared.clone(),
            None => self.insert(make(value)),
        }
    }

    /// Number of distinct values held.
    pub fn len(&self) -> usize {
        self.set.len()
    }

    /// Neither node nor zone nor hints.
    pub fn is_empty(&self) -> bool {
        self.set.is_empty()
    }

    fn insert(&mut self, value: Arc<T>) -> Arc<T> {
        if self.set.len() >= (2 * self.swept_len).max(SWEEP_FLOOR) {
            self.set.retain(|v| Arc::strong_count(v) > 1);
            self.swept_len = self.set.len();
        }
        self.set.insert(value.clone());
        value
    }
}

impl Interner<str> {
    /// The shared copy of a string.
    pub fn string(&mut self, s: &str) -> Arc<str> {
        self.get_or_make(s, |s| Arc::from(s))
    }
}

/// The interners a converted EndpointSlice draws from: one per store, or one per read of a source so that
/// the objects of one snapshot already share before they reach the store.
#[derive(Debug, Default)]
pub struct SharedValues {
    /// Namespaces and port names.
    pub(crate) strings: Interner<str>,
    /// Endpoint topologies (node, zone, hints), shared by the endpoints that have the same.
    pub(crate) topologies: Interner<Topology>,
}

impl SharedValues {
    /// The shared copy of `s`.
    pub fn string(&mut self, s: &str) -> Arc<str> {
        self.strings.string(s)
    }

    /// The shared topology; None for an empty one.
    pub fn topology(&mut self, t: Topology) -> Option<Arc<Topology>> {
        if t.is_empty() {
            return None;
        }
        Some(self.topologies.get_or_make(&t, |t| Arc::new(t.clone())))
    }
}

/// A (namespace, name) pair however it is stored: lets maps keyed by [`SharedName`] be queried with a
/// `&NamespacedName` or a pair of `&str` without building a key.
pub trait NameKey {
    /// The namespace.
    fn namespace(&self) -> &str;
    /// The name.
    fn name(&self) -> &str;
}

impl NameKey for NamespacedName {
    fn namespace(&self) -> &str {
        &self.namespace
    }
    fn name(&self) -> &str {
        &self.name
    }
}

impl NameKey for (&str, &str) {
    fn namespace(&self) -> &str {
        self.0
    }
    fn name(&self) -> &str {
        self.1
    }
}

impl Hash for dyn NameKey + '_ {
    fn hash<H: Hasher>(&self, state: &mut H) {
        self.namespace().hash(state);
        self.name().hash(state);
    }
}

impl PartialEq for dyn NameKey + '_ {
    fn eq(&self, other: &Self) -> bool {
        self.namespace() == other.namespace() && self.name() == other.name()
    }
}

impl Eq for dyn NameKey + '_ {}

/// A namespaced name made of shared strings: 32 bytes and no allocation of its own.
#[derive(Debug, Clone, PartialOrd, Ord)]
pub struct SharedName {
    /// The namespace (shared).
    pub namespace: Arc<str>,
    /// The name (shared).
    pub name: Arc<str>,
}

impl NameKey for SharedName {
    fn namespace(&self) -> &str {
        &self.namespace
    }
    fn name(&self) -> &str {
        &self.name
    }
}

impl SharedName {
    /// An owned copy of the name.
    pub fn to_namespaced_name(&self) -> NamespacedName {
        NamespacedName::new(&*self.namespace, &*self.name)
    }
}

// Hash and Eq go through `dyn NameKey` so that they agree with the borrowed form (what `Borrow` requires).
impl Hash for SharedName {
    fn hash<H: Hasher>(&self, state: &mut H) {
        (self as &dyn NameKey).hash(state)
    }
}

impl PartialEq for SharedName {
    fn eq(&self, other: &Self) -> bool {
        (self as &dyn NameKey) == (other as &dyn NameKey)
    }
}

impl Eq for SharedName {}

impl<'a> Borrow<dyn NameKey + 'a> for SharedName {
    fn borrow(&self) -> &(dyn NameKey + 'a) {
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    #[test]
    fn equal_values_share_one_allocation() {
        let mut i = Interner::<str>::default();
        let a = i.string("node-1");
        let b = i.string(&String::from("node-1"));
        assert!(Arc::ptr_eq(&a, &b));
        let c: Arc<str> = Arc::from("node-1");
        assert!(
            Arc::ptr_eq(&i.share(&c), &a),
            "an equal value maps to the shared one"
        );
        let d: Arc<str> = Arc::from("node-2");
        assert!(Arc::ptr_eq(&i.share(&d), &d), "a new value is adopted");
        assert_eq!(i.len(), 2);
    }

    #[test]
    fn unused_values_are_swept_as_the_set_grows() {
        let mut i = Interner::<str>::default();
        let kept = i.string("kept");
        for n in 0..10 * SWEEP_FLOOR {
            i.string(&format!("dropped-{n}"));
        }
        assert!(i.len() <= SWEEP_FLOOR, "{} values held", i.len());
        assert!(
            Arc::ptr_eq(&i.string("kept"), &kept),
            "a value in use stays"
        );
    }

    #[test]
    fn empty_topology_is_not_stored() {
        let mut s = SharedValues::default();
        assert_eq!(s.topology(Topology::default()), None);
        let t = Topology {
            zone: Some("z1".into()),
            ..Default::default()
        };
        let a = s.topology(t.clone()).unwrap();
        let b = s.topology(t).unwrap();
        assert!(Arc::ptr_eq(&a, &b));
    }

    #[test]
    fn shared_name_keys_are_found_by_borrowed_names() {
        let mut m: HashMap<SharedName, u32> = HashMap::new();
        m.insert(
            SharedName {
                namespace: "ns".into(),
                name: "web".into(),
            },
            7,
        );
        let nn = NamespacedName::new("ns", "web");
        assert_eq!(m.get::<dyn NameKey>(&nn), Some(&7));
        assert_eq!(m.get::<dyn NameKey>(&("ns", "web")), Some(&7));
        assert_eq!(m.get::<dyn NameKey>(&("ns", "we")), None);
        assert_eq!(m.get::<dyn NameKey>(&("nsw", "eb")), None);
    }
}
