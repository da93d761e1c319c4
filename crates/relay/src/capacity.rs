//! Admission: how many TCP connections and UDP flows the relay carries at once, in total, per service port
//! and per client address. A connection is admitted after `accept()` (or a flow at its first datagram) and
//! holds its place until it ends; listeners hold nothing, so no number of listeners or idle services can
//! starve another. A client refused at a limit is told at once (TCP reset) instead of waiting.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

/// The three limits. Each is at least 1.
#[derive(Debug)]
pub(crate) struct Capacity {
    max_total: usize,
    max_per_service: usize,
    max_per_source: usize,
    total: AtomicUsize,
    /// Places held per client address; an address leaves the map when its last connection ends, so the
    /// map never holds more entries than there are live connections.
    sources: Mutex<HashMap<IpAddr, usize>>,
}

/// Which limit refused a connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Refusal {
    /// `--relay-max-connections`.
    Total,
    /// The per-service-port limit.
    Service,
    /// The per-client-address limit.
    Source,
}

impl Refusal {
    /// For logs and metrics.
    pub(crate) fn reason(self) -> &'static str {
        match self {
            Refusal::Total => "relay connection limit",
            Refusal::Service => "per-service connection limit",
            Refusal::Source => "per-client connection limit",
        }
    }
}

/// One admitted connection or flow: its places are given back when it is dropped.
#[derive(Debug)]
pub(crate) struct Admission {
    capacity: Arc<Capacity>,
    service: Arc<AtomicUsize>,
    source: Option<IpAddr>,
}

/// Adds one to `c` unless it has reached `max`.
fn take(c: &AtomicUsize, max: usize) -> bool {
    c.fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
        (n < max).then_some(n + 1)
    })
    .is_ok()
}

impl Capacity {
    pub(crate) fn new(max_total: usize, max_per_service: usize, max_per_source: usize) -> Capacity {
        Capacity {
            max_total: max_total.max(1),
            max_per_service: max_per_service.max(1),
            max_per_source: max_per_source.max(1),
            total: AtomicUsize::new(0),
            sources: Mutex::new(HashMap::new()),
        }
    }

    fn sources(&self) -> std::sync::MutexGuard<'_, HashMap<IpAddr, usize>> {
        self.sources.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Admits a connection from `source` to the service whose live count is `service`, or says which limit
    /// refuses it. Loopback clients are the node itself (every localhost NodePort client has the same
    /// address), so only the service and total limits apply to them.
    pub(crate) fn admit(
        self: &Arc<Self>,
        service: &Arc<AtomicUsize>,
        source: IpAddr,
    ) -> Result<Admission, Refusal> {
        let counted = (!source.is_loopback()).then_some(source);
        if let Some(ip) = counted {
            let mut map = self.sources();
            let held = map.entry(ip).or_insert(0);
            if *held >= self.max_per_source {
                return Err(Refusal::Source);
            }
            *held += 1;
        }
        if !take(service, self.max_per_service) {
            self.release_source(counted);
            return Err(Refusal::Service);
        }
        if !take(&self.total, self.max_total) {
            service.fetch_sub(1, Ordering::AcqRel);
            self.release_source(counted);
            return Err(Refusal::Total);
        }
        Ok(Admission {
            capacity: self.clone(),
            service: service.clone(),
            source: counted,
        })
    }

    /// Gives back one place of `source` (None: a client not counted per address).
    fn release_source(&self, source: Option<IpAddr>) {
        let Some(ip) = source else { return };
        let mut map = self.sources();
        if let Some(held) = map.get_mut(&ip) {
            *held -= 1;
            if *held == 0 {
                map.remove(&ip);
            }
        }
    }

    /// Connections and flows admitted and not yet ended.
    #[cfg(test)]
    pub(crate) fn in_use(&self) -> usize {
        self.total.load(Ordering::Acquire)
    }

    #[cfg(test)]
    fn tracked_sources(&self) -> usize {
        self.sources().len()
    }
}

impl Drop for Admission {
    fn drop(&mut self) {
        self.capacity.total.fetch_sub(1, Ordering::AcqRel);
        self.service.fetch_sub(1, Ordering::AcqRel);
        self.capacity.release_source(self.source);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(i: u8) -> IpAddr {
        IpAddr::from([192, 0, 2, i])
    }

    #[test]
    fn each_limit_refuses_with_its_own_reason_and_places_come_back_on_drop() {
        let cap = Arc::new(Capacity::new(4, 3, 2));
        let (a, b) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
        let a1 = cap.admit(&a, ip(1)).unwrap();
        let _a2 = cap.admit(&a, ip(1)).unwrap();
        assert_eq!(cap.admit(&a, ip(1)).unwrap_err(), Refusal::Source);
        let _a3 = cap.admit(&a, ip(2)).unwrap();
        assert_eq!(cap.admit(&a, ip(3)).unwrap_err(), Refusal::Service);
        let _b1 = cap.admit(&b, ip(3)).unwrap();
        assert_eq!(cap.admit(&b, ip(4)).unwrap_err(), Refusal::Total);
        // Refusals took nothing: the counts are those of the four admitted.
        assert_eq!(cap.in_use(), 4);
        assert_eq!(a.load(Ordering::Acquire), 3);
        assert_eq!(b.load(Ordering::Acquire), 1);
        assert_eq!(cap.tracked_sources(), 3);
        drop(a1);
        assert_eq!(cap.in_use(), 3);
        let _b2 = cap.admit(&b, ip(4)).unwrap();
    }

    #[test]
    fn sources_leave_the_map_with_their_last_connection() {
        let cap = Arc::new(Capacity::new(1000, 1000, 1));
        let svc = Arc::new(AtomicUsize::new(0));
        let held: Vec<_> = (0..100).map(|i| cap.admit(&svc, ip(i)).unwrap()).collect();
        assert_eq!(cap.tracked_sources(), 100);
        drop(held);
        assert_eq!(cap.tracked_sources(), 0);
        assert_eq!(cap.in_use(), 0);
        assert_eq!(svc.load(Ordering::Acquire), 0);
    }

    #[test]
    fn loopback_clients_are_bounded_by_the_service_and_total_limits_only() {
        let cap = Arc::new(Capacity::new(10, 5, 1));
        let svc = Arc::new(AtomicUsize::new(0));
        let lo = IpAddr::from([127, 0, 0, 1]);
        let held: Vec<_> = (0..5).map(|_| cap.admit(&svc, lo).unwrap()).collect();
        assert_eq!(cap.admit(&svc, lo).unwrap_err(), Refusal::Service);
        assert_eq!(cap.tracked_sources(), 0);
        drop(held);
    }
}
