//! Which service port holds each frontend. Two ports claiming one frontend (two Services given the same
//! ClusterIP and port: bad input) must not both reach the kernel, which would refuse the batch (EEXIST):
//! the first claimant (in name order on a full sync) keeps it, the other is logged and waits until the
//! frontend is free and it is rendered again. The sync engine's index and the desired tables both decide
//! through this one type, so what is committed and what `plan` shows agree.
//!
//! A claim covers one key of a per-service set, less the endpoint slot where keys have one: the slots of a
//! service are one claim. Shared sets (ClusterIPs, hairpin pairs) are not claimed: several ports may want
//! the same element there.

use super::names::{PieceSet, SET_CLUSTER_IPS, SET_HAIRPIN};
use crate::model::ServicePortName;
use crate::nft::ir::{Element, Family};
use std::collections::HashMap;
use std::hash::{BuildHasher, Hash, RandomState};
use std::sync::Arc;

/// Whether elements of this set may be wanted by more than one service port.
pub fn shared_set(set: PieceSet) -> bool {
    [SET_CLUSTER_IPS, SET_HAIRPIN].contains(&set.name())
}

/// A 128-bit fingerprint of an element's identity, standing in for its bytes in maps that hold hundreds of
/// thousands of them (~80 MB as bytes at 50k services, ~20 MB as fingerprints). Two different identities
/// share one with probability ~n²/2¹²⁹ (≈1e-28 at 300k), and the hash keys are random per process, so
/// nobody can craft a collision. Two u64 rather than a u128: a u128 is 16-byte aligned, which pads every map
/// entry to 32 bytes.
pub type Fingerprint = [u64; 2];

/// Two independently keyed SipHashes make one 128-bit fingerprint.
#[derive(Debug, Default, Clone)]
pub struct Fingerprinter {
    high: RandomState,
    low: RandomState,
}

impl Fingerprinter {
    /// The fingerprint of `value`.
    pub fn of(&self, value: &impl Hash) -> Fingerprint {
        [self.high.hash_one(value), self.low.hash_one(value)]
    }
}

/// A frontend held by a service port, for that many of its elements.
#[derive(Debug, Clone)]
struct Claim {
    holder: Arc<ServicePortName>,
    elements: u32,
}

/// Who holds each frontend of the per-service sets: the first claimant (in name order), until its last
/// element of that frontend goes.
#[derive(Debug, Default, Clone)]
pub struct Claims {
    claims: HashMap<Fingerprint, Claim>,
    fingerprints: Fingerprinter,
}

impl Claims {
    fn key(&self, family: Family, set: PieceSet, element: &Element) -> Fingerprint {
        let key: &[u8] = &element.key;
        let frontend = match set.has_slot_keys() {
            true => &key[..key.len().saturating_sub(4)],
            false => key,
        };
        self.fingerprints.of(&(family, set, frontend))
    }

    /// Counts `element` for `holder` if its frontend is free or already `holder`'s; otherwise returns the
    /// port that holds it.
    pub fn acquire(
        &mut self,
        holder: &Arc<ServicePortName>,
        family: Family,
        set: PieceSet,
        element: &Element,
    ) -> Result<(), Arc<ServicePortName>> {
        let key = self.key(family, set, element);
        match self.claims.get_mut(&key) {
            Some(claim) if *claim.holder != **holder => Err(claim.holder.clone()),
            Some(claim) => {
                claim.elements += 1;
                Ok(())
            }
            None => {
                let claim = Claim {
                    holder: holder.clone(),
                    elements: 1,
                };
                self.claims.insert(key, claim);
                Ok(())
            }
        }
    }

    /// Uncounts `element` of `holder`; false if the frontend was not `holder`'s (nothing of it was
    /// committed).
    pub fn release(
        &mut self,
        holder: &ServicePortName,
        family: Family,
        set: PieceSet,
        element: &Element,
    ) -> bool {
        let key = self.key(family, set, element);
        match self.claims.get_mut(&key) {
            Some(claim) if *claim.holder == *holder => {
                claim.elements -= 1;
                if claim.elements == 0 {
                    self.claims.remove(&key);
                }
                true
            }
            _ => false,
        }
    }

    /// Whether `holder` holds the frontend of `element`.
    pub fn holds(
        &self,
        holder: &ServicePortName,
        family: Family,
        set: PieceSet,
        element: &Element,
    ) -> bool {
        self.claims
            .get(&self.key(family, set, element))
            .is_some_and(|c| *c.holder == *holder)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{NamespacedName, Protocol};
    use crate::render::names::{MAP_SERVICE_ENDPOINTS, MAP_SERVICE_IPS};

    fn spn(name: &str) -> Arc<ServicePortName> {
        Arc::new(ServicePortName {
            service: NamespacedName::new("ns", name),
            port: "".into(),
            protocol: Protocol::Tcp,
        })
    }

    fn el(key: &[u8]) -> Element {
        Element {
            key: key.into(),
            value: None,
        }
    }

    #[test]
    fn a_services_slots_are_one_claim_and_the_first_claimant_keeps_the_frontend() {
        let (a, b) = (spn("a"), spn("b"));
        let slots = PieceSet::named(MAP_SERVICE_ENDPOINTS);
        let dispatch = PieceSet::named(MAP_SERVICE_IPS);
        let frontend = [10, 96, 0, 1, 6, 0, 0, 0, 0, 80, 0, 0];
        let slot = |k: u8| el(&[&frontend[..], &[k, 0, 0, 0]].concat());
        let mut c = Claims::default();
        assert!(c.acquire(&a, Family::Ip, slots, &slot(0)).is_ok());
        assert!(c.acquire(&a, Family::Ip, slots, &slot(1)).is_ok());
        // b's slots, even one that a has no element at, are a's frontend.
        assert_eq!(c.acquire(&b, Family::Ip, slots, &slot(2)), Err(a.clone()));
        assert!(!c.holds(&b, Family::Ip, slots, &slot(2)));
        assert!(c.holds(&a, Family::Ip, slots, &slot(7)));
        // The dispatch key is a claim of its own set; the other family is another frontend.
        assert!(c.acquire(&b, Family::Ip, dispatch, &el(&frontend)).is_ok());
        assert!(c.acquire(&b, Family::Ip6, slots, &slot(0)).is_ok());
        // a lets go of its frontend only with its last slot.
        assert!(!c.release(&b, Family::Ip, slots, &slot(0)));
        assert!(c.release(&a, Family::Ip, slots, &slot(0)));
        assert!(c.holds(&a, Family::Ip, slots, &slot(0)));
        assert!(c.release(&a, Family::Ip, slots, &slot(1)));
        assert!(c.acquire(&b, Family::Ip, slots, &slot(2)).is_ok());
    }
}
