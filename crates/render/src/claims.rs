//! Which service port holds each frontend. Two ports claiming one frontend (a Service whose `externalIPs`
//! name another's ClusterIP and port, or two Services given the same ClusterIP) must not both reach the
//! kernel, which would refuse the batch (EEXIST), and who wins must be nothing a tenant can choose by naming
//! its objects: a ClusterIP (allocated and kept unique by the API server) first, then a LoadBalancer ingress
//! IP (status, written by a controller), then an external IP (any Service owner may write one); within a
//! kind, the oldest object, then namespace/name. The others wait, and the best of them takes the frontend
//! when its holder lets go. The sync engine's index and the desired tables both decide through this one
//! type, so what is committed and what `plan` shows agree, whatever order the claims came in.
//!
//! A claim covers one frontend in every per-service set: `addr . proto . port` (dispatch, endpoint slots less
//! their slot, no-endpoint and no-local sets, affinity, relay ports) or a NodePort's `proto . port`. One
//! holder therefore has all of a frontend's elements, never one set each. Shared sets (ClusterIPs, hairpin
//! pairs, the protocols of affinity frontends) are not claimed: several ports may want the same element.

use super::names::{PieceSet, SET_AFFINITY_PROTOCOLS, SET_CLUSTER_IPS, SET_HAIRPIN};
use nftkube_model::{Created, ServicePort, ServicePortName};
use nftkube_nft::ir::{Element, Family};
use std::collections::HashMap;
use std::hash::{BuildHasher, Hash, RandomState};
use std::net::IpAddr;
use std::sync::Arc;

/// Whether elements of this set may be wanted by more than one service port.
pub fn shared_set(set: PieceSet) -> bool {
    [SET_CLUSTER_IPS, SET_HAIRPIN, SET_AFFINITY_PROTOCOLS].contains(&set.name())
}

/// Whether `piece` of `holder` is in the kernel: a chain or a shared element always, an element of a
/// per-service set when `holder` holds its frontend.
pub fn committed(claims: &Claims, holder: &ServicePortName, piece: &super::Piece) -> bool {
    match piece {
        super::Piece::Element {
            family,
            set,
            element,
            ..
        } if !shared_set(*set) => claims.holds(holder, *family, *set, element),
        _ => true,
    }
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

/// The kind of frontend an element belongs to, in the order a contested frontend is given.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum FrontendKind {
    /// A ClusterIP: allocated by the API server, which keeps it unique.
    ClusterIp,
    /// A LoadBalancer ingress IP: service status, set by a controller.
    LoadBalancer,
    /// A `spec.externalIPs` address: whoever may write the Service chooses it.
    External,
    /// A NodePort (contested only by other NodePorts: they have keys of their own).
    NodePort,
}

/// How strongly an element's service port claims its frontend: lower wins.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Precedence {
    /// The frontend's kind, first.
    pub kind: FrontendKind,
    /// Then the service's age.
    pub created: Created,
}

impl Precedence {
    /// The precedence of `svc`'s frontend of this kind.
    pub fn of(svc: &ServicePort, kind: FrontendKind) -> Precedence {
        Precedence {
            kind,
            created: svc.created,
        }
    }

    /// The precedence of `svc`'s frontend on address `ip` (a ClusterIP, else a LoadBalancer IP, else an
    /// external IP: an address listed twice ranks as its best).
    pub fn of_address(svc: &ServicePort, ip: &IpAddr) -> Precedence {
        let kind = if svc.cluster_ips.contains(ip) {
            FrontendKind::ClusterIp
        } else if svc.load_balancer_ips.contains(ip) {
            FrontendKind::LoadBalancer
        } else {
            FrontendKind::External
        };
        Precedence::of(svc, kind)
    }
}

/// A service port claiming a frontend, for that many of its elements.
#[derive(Debug, Clone)]
struct Claimant {
    holder: Arc<ServicePortName>,
    precedence: Precedence,
    elements: u32,
}

impl Claimant {
    fn ranks_before(&self, precedence: Precedence, holder: &ServicePortName) -> bool {
        (self.precedence, &*self.holder) < (precedence, holder)
    }
}

/// What claiming an element's frontend did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Acquired {
    /// The claimant holds the frontend (it already did, or it was free): the element is committed.
    Holds,
    /// It took the frontend from this port, whose elements of it leave the kernel.
    TookOver(Arc<ServicePortName>),
    /// `holder` holds the frontend and ranks first; the claim waits (`new`: it was not waiting before).
    Waits {
        /// The port that holds the frontend.
        holder: Arc<ServicePortName>,
        /// Whether this is the claimant's first element of the frontend.
        new: bool,
    },
}

/// What giving up an element's claim did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Released {
    /// The element was committed (its holder's), and leaves the kernel.
    Held,
    /// The holder's last element went, and this port, the best waiting, holds the frontend now: its elements
    /// of it enter the kernel.
    HandedOver(Arc<ServicePortName>),
    /// The element was never committed (its claim was waiting, or unknown).
    NotHeld,
}

/// Who claims each frontend of the per-service sets, best first (see the module).
#[derive(Debug, Default, Clone)]
pub struct Claims {
    /// Per frontend, its claimants in precedence order: the first holds it.
    frontends: HashMap<Fingerprint, Vec<Claimant>>,
    /// Claimants in all (so that waiting claims are counted without a walk).
    claimants: usize,
    fingerprints: Fingerprinter,
}

impl Claims {
    /// The claim key of an element: its family and frontend (see the module), not its set.
    pub fn key(&self, family: Family, set: PieceSet, element: &Element) -> Fingerprint {
        let key: &[u8] = &element.key;
        let frontend = match set.has_slot_keys() {
            true => &key[..key.len().saturating_sub(4)],
            false => key,
        };
        self.fingerprints
            .of(&(family, set.is_nodeport_keyed(), frontend))
    }

    /// Counts `element` for `holder`, which claims its frontend with `precedence`.
    pub fn acquire(
        &mut self,
        holder: &Arc<ServicePortName>,
        precedence: Precedence,
        family: Family,
        set: PieceSet,
        element: &Element,
    ) -> Acquired {
        let key = self.key(family, set, element);
        let claimants = self.frontends.entry(key).or_default();
        if let Some(c) = claimants.iter_mut().find(|c| *c.holder == **holder) {
            c.elements += 1;
            return match *claimants[0].holder == **holder {
                true => Acquired::Holds,
                false => Acquired::Waits {
                    holder: claimants[0].holder.clone(),
                    new: false,
                },
            };
        }
        let at = claimants
            .iter()
            .position(|c| !c.ranks_before(precedence, holder))
            .unwrap_or(claimants.len());
        let former = claimants.first().map(|c| c.holder.clone());
        claimants.insert(
            at,
            Claimant {
                holder: holder.clone(),
                precedence,
                elements: 1,
            },
        );
        self.claimants += 1;
        match (at, former) {
            (0, Some(former)) => Acquired::TookOver(former),
            (0, None) => Acquired::Holds,
            (_, Some(first)) => Acquired::Waits {
                holder: first,
                new: true,
            },
            (_, None) => unreachable!("a claimant after the first has a first before it"),
        }
    }

    /// Uncounts `element` of `holder`.
    pub fn release(
        &mut self,
        holder: &ServicePortName,
        family: Family,
        set: PieceSet,
        element: &Element,
    ) -> Released {
        let key = self.key(family, set, element);
        let Some(claimants) = self.frontends.get_mut(&key) else {
            return Released::NotHeld;
        };
        let Some(at) = claimants.iter().position(|c| *c.holder == *holder) else {
            return Released::NotHeld;
        };
        claimants[at].elements -= 1;
        if claimants[at].elements > 0 {
            return match at {
                0 => Released::Held,
                _ => Released::NotHeld,
            };
        }
        claimants.remove(at);
        self.claimants -= 1;
        let next = claimants.first().map(|c| c.holder.clone());
        if next.is_none() {
            self.frontends.remove(&key);
        }
        match (at, next) {
            (0, Some(next)) => Released::HandedOver(next),
            (0, None) => Released::Held,
            _ => Released::NotHeld,
        }
    }

    /// Whether `holder` holds the frontend of `element`.
    pub(crate) fn holds(
        &self,
        holder: &ServicePortName,
        family: Family,
        set: PieceSet,
        element: &Element,
    ) -> bool {
        self.holder_of(self.key(family, set, element))
            .is_some_and(|h| **h == *holder)
    }

    /// Who holds the frontend of this claim key.
    pub fn holder_of(&self, key: Fingerprint) -> Option<&Arc<ServicePortName>> {
        self.frontends.get(&key)?.first().map(|c| &c.holder)
    }

    /// Every waiting claimant with the port that holds its frontend.
    pub fn waiting(&self) -> impl Iterator<Item = (&Arc<ServicePortName>, &Arc<ServicePortName>)> {
        self.frontends
            .values()
            .flat_map(|c| c[1..].iter().map(move |w| (&w.holder, &c[0].holder)))
    }

    /// Claims that wait because another port holds their frontend.
    pub fn refused(&self) -> usize {
        self.claimants - self.frontends.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::names::{MAP_SERVICE_ENDPOINTS, MAP_SERVICE_IPS};
    use nftkube_model::{NamespacedName, Protocol};

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

    fn first(kind: FrontendKind) -> Precedence {
        Precedence {
            kind,
            created: Created::UNKNOWN,
        }
    }

    #[test]
    fn a_frontends_elements_in_every_set_are_one_claim_and_the_best_claimant_holds_it() {
        let (a, b) = (spn("a"), spn("b"));
        let slots = PieceSet::named(MAP_SERVICE_ENDPOINTS);
        let dispatch = PieceSet::named(MAP_SERVICE_IPS);
        let frontend = [10, 96, 0, 1, 6, 0, 0, 0, 0, 80, 0, 0];
        let slot = |k: u8| el(&[&frontend[..], &[k, 0, 0, 0]].concat());
        let cluster = first(FrontendKind::ClusterIp);
        let mut c = Claims::default();
        assert_eq!(
            c.acquire(&a, cluster, Family::Ip, slots, &slot(0)),
            Acquired::Holds
        );
        assert_eq!(
            c.acquire(&a, cluster, Family::Ip, dispatch, &el(&frontend)),
            Acquired::Holds
        );
        // b's slots, even one that a has no element at, and its dispatch element are a's frontend.
        let waits = Acquired::Waits {
            holder: a.clone(),
            new: true,
        };
        assert_eq!(c.acquire(&b, cluster, Family::Ip, slots, &slot(2)), waits);
        assert!(matches!(
            c.acquire(&b, cluster, Family::Ip, dispatch, &el(&frontend)),
            Acquired::Waits { new: false, .. }
        ));
        assert!(!c.holds(&b, Family::Ip, slots, &slot(2)));
        assert!(c.holds(&a, Family::Ip, slots, &slot(7)));
        assert_eq!(c.refused(), 1);
        // The other family is another frontend.
        assert_eq!(
            c.acquire(&b, cluster, Family::Ip6, slots, &slot(0)),
            Acquired::Holds
        );
        // a lets go of its frontend with its last element, and b, waiting, holds it then.
        assert_eq!(c.release(&b, Family::Ip6, slots, &slot(0)), Released::Held);
        assert_eq!(c.release(&a, Family::Ip, slots, &slot(0)), Released::Held);
        assert!(c.holds(&a, Family::Ip, slots, &slot(0)));
        assert_eq!(
            c.release(&a, Family::Ip, dispatch, &el(&frontend)),
            Released::HandedOver(b.clone())
        );
        assert!(c.holds(&b, Family::Ip, slots, &slot(2)));
        assert_eq!(c.refused(), 0);
    }

    #[test]
    fn a_clusterip_outranks_a_load_balancer_ip_which_outranks_an_external_ip_whoever_came_first() {
        // "aaa" sorts first and claims first: neither helps it.
        let (ext, lb, cip) = (spn("aaa-external"), spn("bbb-lb"), spn("zzz-cluster"));
        let dispatch = PieceSet::named(MAP_SERVICE_IPS);
        let frontend = el(&[10, 96, 0, 1, 6, 0, 0, 0, 1, 187, 0, 0]);
        let mut c = Claims::default();
        let ext_kind = first(FrontendKind::External);
        assert_eq!(
            c.acquire(&ext, ext_kind, Family::Ip, dispatch, &frontend),
            Acquired::Holds
        );
        let lb_kind = first(FrontendKind::LoadBalancer);
        assert_eq!(
            c.acquire(&lb, lb_kind, Family::Ip, dispatch, &frontend),
            Acquired::TookOver(ext.clone())
        );
        let cip_kind = first(FrontendKind::ClusterIp);
        assert_eq!(
            c.acquire(&cip, cip_kind, Family::Ip, dispatch, &frontend),
            Acquired::TookOver(lb.clone())
        );
        assert_eq!(c.refused(), 2);
        // The best of those waiting comes next: the LoadBalancer IP, not the earlier external IP.
        assert_eq!(
            c.release(&cip, Family::Ip, dispatch, &frontend),
            Released::HandedOver(lb.clone())
        );
    }

    #[test]
    fn within_a_kind_the_oldest_service_wins_and_an_unknown_age_ranks_last() {
        let (young, old, unknown) = (spn("a-young"), spn("b-old"), spn("0-unknown"));
        let dispatch = PieceSet::named(MAP_SERVICE_IPS);
        let frontend = el(&[192, 0, 2, 1, 6, 0, 0, 0, 0, 80, 0, 0]);
        let aged = |t: i64| Precedence {
            kind: FrontendKind::External,
            created: Created::from_unix_seconds(t),
        };
        let mut c = Claims::default();
        let unknown_age = first(FrontendKind::External);
        c.acquire(&unknown, unknown_age, Family::Ip, dispatch, &frontend);
        c.acquire(&young, aged(2_000_000_000), Family::Ip, dispatch, &frontend);
        c.acquire(&old, aged(1_000_000_000), Family::Ip, dispatch, &frontend);
        assert!(c.holds(&old, Family::Ip, dispatch, &frontend));
        c.release(&old, Family::Ip, dispatch, &frontend);
        assert!(c.holds(&young, Family::Ip, dispatch, &frontend));
    }
}
