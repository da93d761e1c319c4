//! ClientIP affinity entries that point at an endpoint their frontend no longer has.
//!
//! The packet path fills the `affinity` map (`client . frontend : endpoint`) and looks it up before choosing
//! an endpoint, so an entry left pointing at a removed endpoint would keep sending its client there until
//! it times out (three hours by default). kube-proxy's `recent` lists are per endpoint and vanish with it;
//! here the agent deletes such entries after each commit that removed endpoints.
//!
//! An entry's key is `saddr . daddr . proto . port`; the endpoint maps' keys are `daddr . proto . port .
//! slot` (frontends) and `proto . port . slot` (NodePorts). With every component padded to 4 bytes, an
//! entry's key minus its client is the frontend part of an endpoint-map key minus its slot.

use nftkube_nft::ir::{Element, ElementValue, Family};
use nftkube_render::names::{
    MAP_AFFINITY_NODEPORTS, MAP_AFFINITY_SERVICES, MAP_NODEPORT_ENDPOINTS, MAP_SERVICE_ENDPOINTS,
};
use nftkube_render::Piece;
use std::collections::HashSet;

/// The maps that send a frontend's (or a NodePort's) new connections to have their endpoint recorded: a
/// frontend with an element there has ClientIP affinity.
pub(crate) const AFFINITY_MAPS: [&str; 2] = [MAP_AFFINITY_SERVICES, MAP_AFFINITY_NODEPORTS];

/// Whether a service port's pieces give it ClientIP affinity (its frontends are in the affinity maps).
pub(crate) fn has_affinity(pieces: &[Piece]) -> bool {
    pieces
        .iter()
        .any(|p| matches!(p, Piece::Element { set, .. } if AFFINITY_MAPS.contains(&set.name())))
}

/// (frontend key without slot, endpoint) pairs of one family's endpoint maps.
#[derive(Debug, Default)]
pub(crate) struct EndpointPairs {
    frontends: HashSet<(Vec<u8>, Vec<u8>)>,
    nodeports: HashSet<(Vec<u8>, Vec<u8>)>,
}

impl EndpointPairs {
    /// Notes an element of `set` if it is an endpoint slot; other sets are ignored.
    pub(crate) fn add(&mut self, set: &str, e: &Element) {
        let Some(pair) = slot_pair(e) else { return };
        match set {
            MAP_SERVICE_ENDPOINTS => self.frontends.insert(pair),
            MAP_NODEPORT_ENDPOINTS => self.nodeports.insert(pair),
            _ => false,
        };
    }

    /// Forgets an element (it left the kernel).
    pub(crate) fn remove(&mut self, set: &str, e: &Element) {
        let Some(pair) = slot_pair(e) else { return };
        match set {
            MAP_SERVICE_ENDPOINTS => self.frontends.remove(&pair),
            MAP_NODEPORT_ENDPOINTS => self.nodeports.remove(&pair),
            _ => false,
        };
    }

    /// Nothing pending.
    pub(crate) fn is_empty(&self) -> bool {
        self.frontends.is_empty() && self.nodeports.is_empty()
    }

    /// Whether an affinity entry's (frontend, endpoint) is one of these pairs.
    fn covers(&self, family: Family, entry: &Element) -> bool {
        let Some((frontend, nodeport, endpoint)) = entry_parts(family, entry) else {
            return false;
        };
        self.frontends
            .contains(&(frontend.to_vec(), endpoint.to_vec()))
            || self
                .nodeports
                .contains(&(nodeport.to_vec(), endpoint.to_vec()))
    }
}

/// Entries whose endpoint is not among the valid pairs (a full sync: `valid` holds every endpoint slot).
pub(crate) fn stale_against_valid(
    family: Family,
    entries: &[Element],
    valid: &EndpointPairs,
) -> Vec<Element> {
    entries
        .iter()
        .filter(|e| !valid.covers(family, e))
        .cloned()
        .collect()
}

/// Entries pointing at a (frontend, endpoint) pair that a partial sync removed and did not add back. An
/// entry whose port is also a removed NodePort's is deleted too: at worst its client chooses again.
pub(crate) fn stale_against_removed(
    family: Family,
    entries: &[Element],
    removed: &EndpointPairs,
) -> Vec<Element> {
    entries
        .iter()
        .filter(|e| removed.covers(family, e))
        .cloned()
        .collect()
}

/// Frontends that gained ClientIP affinity in a partial sync (a service turned it on, or one with affinity
/// took the frontend over from another), with their endpoints now. Entries of such a frontend were
/// recorded for another holder or another time: those that point elsewhere are stale.
#[derive(Debug, Default)]
pub(crate) struct GainedAffinity {
    frontends: HashSet<Vec<u8>>,
    nodeports: HashSet<Vec<u8>>,
    current: EndpointPairs,
}

impl GainedAffinity {
    /// Notes an element added to an affinity set: its key is the frontend (or NodePort) that gained it.
    pub(crate) fn gained(&mut self, set: &str, e: &Element) {
        match set {
            MAP_AFFINITY_SERVICES => self.frontends.insert(e.key.to_vec()),
            MAP_AFFINITY_NODEPORTS => self.nodeports.insert(e.key.to_vec()),
            _ => false,
        };
    }

    /// Notes an endpoint slot the frontend has now.
    pub(crate) fn current(&mut self, set: &str, e: &Element) {
        self.current.add(set, e);
    }

    /// Entries of a gained frontend whose endpoint it does not have.
    pub(crate) fn stale(&self, family: Family, entries: &[Element]) -> Vec<Element> {
        entries
            .iter()
            .filter(|e| {
                let Some((frontend, nodeport, _)) = entry_parts(family, e) else {
                    return false;
                };
                let gained = self.frontends.contains(frontend) || self.nodeports.contains(nodeport);
                gained && !self.current.covers(family, e)
            })
            .cloned()
            .collect()
    }
}

/// (frontend key without the slot, endpoint value) of an endpoint-slot element.
fn slot_pair(e: &Element) -> Option<(Vec<u8>, Vec<u8>)> {
    let Some(ElementValue::Data(endpoint)) = &e.value else {
        return None;
    };
    let frontend = e.key.get(..e.key.len().checked_sub(4)?)?;
    Some((frontend.to_vec(), endpoint.to_vec()))
}

/// (frontend `daddr . proto . port`, NodePort `proto . port`, endpoint) of an affinity entry.
fn entry_parts(family: Family, e: &Element) -> Option<(&[u8], &[u8], &[u8])> {
    let Some(ElementValue::Data(endpoint)) = &e.value else {
        return None;
    };
    let addr = if family == Family::Ip6 { 16 } else { 4 };
    let frontend = e.key.get(addr..)?;
    let nodeport = e.key.get(2 * addr..)?;
    Some((frontend, nodeport, endpoint))
}

#[cfg(test)]
mod tests {
    use super::*;
    use nftkube_nft::build::concat_key;

    fn data(key: Vec<u8>, value: Vec<u8>) -> Element {
        Element {
            key: key.into(),
            value: Some(ElementValue::Data(value.into())),
        }
    }

    fn endpoint(last: u8) -> Vec<u8> {
        concat_key(&[vec![10, 244, 0, last], 8080u16.to_be_bytes().to_vec()])
    }

    fn slot(frontend: &[Vec<u8>], k: u32, ep: u8) -> Element {
        let mut key = frontend.to_vec();
        key.push(k.to_ne_bytes().to_vec());
        data(concat_key(&key), endpoint(ep))
    }

    fn entry(client: u8, frontend: &[Vec<u8>], ep: u8) -> Element {
        let mut key = vec![vec![192, 0, 2, client]];
        key.extend_from_slice(frontend);
        data(concat_key(&key), endpoint(ep))
    }

    #[test]
    fn entries_are_kept_exactly_while_their_frontend_has_their_endpoint() {
        let vip = vec![vec![10, 96, 0, 1], vec![6], 80u16.to_be_bytes().to_vec()];
        let node = vec![
            vec![192, 0, 2, 100],
            vec![6],
            30080u16.to_be_bytes().to_vec(),
        ];
        let np = vec![vec![6], 30080u16.to_be_bytes().to_vec()];
        let mut valid = EndpointPairs::default();
        valid.add(MAP_SERVICE_ENDPOINTS, &slot(&vip, 0, 1));
        valid.add(MAP_NODEPORT_ENDPOINTS, &slot(&np, 0, 1));
        let entries = [
            entry(1, &vip, 1),  // valid
            entry(2, &vip, 2),  // endpoint 2 is gone
            entry(3, &node, 1), // NodePort, valid
            entry(4, &node, 2), // NodePort, gone
        ];
        let stale = stale_against_valid(Family::Ip, &entries, &valid);
        assert_eq!(stale, vec![entries[1].clone(), entries[3].clone()]);

        let mut removed = EndpointPairs::default();
        removed.add(MAP_SERVICE_ENDPOINTS, &slot(&vip, 1, 2));
        assert_eq!(
            stale_against_removed(Family::Ip, &entries, &removed),
            vec![entries[1].clone()]
        );
        // Removed from one slot and added in another (an endpoint-count change): not stale.
        removed.remove(MAP_SERVICE_ENDPOINTS, &slot(&vip, 0, 2));
        assert!(removed.is_empty());
    }

    #[test]
    fn a_frontend_that_gains_affinity_keeps_only_entries_of_its_endpoints() {
        let vip = vec![vec![10, 96, 0, 1], vec![6], 80u16.to_be_bytes().to_vec()];
        let other = vec![vec![10, 96, 0, 2], vec![6], 80u16.to_be_bytes().to_vec()];
        let mut gained = GainedAffinity::default();
        gained.gained(MAP_AFFINITY_SERVICES, &data(concat_key(&vip), vec![]));
        gained.current(MAP_SERVICE_ENDPOINTS, &slot(&vip, 0, 3));
        let entries = [entry(1, &vip, 3), entry(2, &vip, 2), entry(3, &other, 2)];
        // The entry to endpoint 2 was a former holder's; another frontend's entries are not looked at.
        assert_eq!(gained.stale(Family::Ip, &entries), vec![entries[1].clone()]);
    }
}
