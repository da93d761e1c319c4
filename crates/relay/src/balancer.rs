//! Endpoint choice for one relayed service port: round robin over the ready endpoints, with ClientIP affinity
//! (kube-proxy userspace's `LoadBalancerRR`). Pure: time is passed in, nothing here does I/O.

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::time::{Duration, Instant};

/// Pins one balancer holds at most. Clients come from addresses a hostile sender can choose (UDP sources are
/// not verified), so the map must not grow with them: beyond this the least recently used pins go, and
/// their clients are balanced afresh when they return (affinity lost, nothing else).
pub(crate) const MAX_PINS: usize = 16_384;

/// Round robin with optional ClientIP affinity.
#[derive(Debug)]
pub struct Balancer {
    endpoints: Vec<SocketAddr>,
    /// Index of the endpoint the next unpinned client gets.
    next: usize,
    /// `Some(ttl)`: a client keeps its endpoint while it comes back within `ttl` of its last connection.
    affinity_ttl: Option<Duration>,
    pinned: HashMap<IpAddr, Pin>,
    /// Entries at the last sweep of expired ones: the next sweep waits until the map doubled, so sweeping
    /// costs amortised O(1) per connection.
    swept_at: usize,
    max_pins: usize,
}

#[derive(Debug, Clone, Copy)]
struct Pin {
    endpoint: SocketAddr,
    last_used: Instant,
}

impl Balancer {
    /// A balancer with no endpoints; `affinity_ttl`: ClientIP affinity for that long.
    pub fn new(affinity_ttl: Option<Duration>) -> Balancer {
        Balancer::with_max_pins(affinity_ttl, MAX_PINS)
    }

    /// As [`Balancer::new`], holding at most `max_pins` (at least 1) pins.
    pub fn with_max_pins(affinity_ttl: Option<Duration>, max_pins: usize) -> Balancer {
        Balancer {
            endpoints: Vec::new(),
            next: 0,
            affinity_ttl,
            pinned: HashMap::new(),
            swept_at: 0,
            max_pins: max_pins.max(1),
        }
    }

    /// The current endpoints.
    pub fn endpoints(&self) -> &[SocketAddr] {
        &self.endpoints
    }

    /// Replaces the endpoint list. Clients pinned to an endpoint that remains stay pinned; pins to removed
    /// endpoints go. The round-robin position is kept (wrapped into the new list).
    pub(crate) fn set_endpoints(&mut self, endpoints: Vec<SocketAddr>) {
        self.pinned.retain(|_, p| endpoints.contains(&p.endpoint));
        self.endpoints = endpoints;
        if self.next >= self.endpoints.len() {
            self.next = 0;
        }
    }

    /// Changes the affinity timeout (None: no affinity, every pin dropped).
    pub(crate) fn set_affinity(&mut self, ttl: Option<Duration>) {
        if ttl.is_none() {
            self.pinned.clear();
        }
        self.affinity_ttl = ttl;
    }

    /// The endpoint for a new connection from `client`. `reset`: the client's previous choice just failed to
    /// dial, so its pin is ignored and replaced. None when there is no endpoint.
    pub(crate) fn pick(&mut self, client: IpAddr, reset: bool, now: Instant) -> Option<SocketAddr> {
        if self.endpoints.is_empty() {
            return None;
        }
        let Some(ttl) = self.affinity_ttl else {
            return Some(self.round_robin());
        };
        if !reset {
            if let Some(pin) = self.pinned.get_mut(&client) {
                if now.saturating_duration_since(pin.last_used) < ttl {
                    pin.last_used = now;
                    return Some(pin.endpoint);
                }
            }
        }
        let endpoint = self.round_robin();
        if !self.pinned.contains_key(&client) && self.pinned.len() >= self.max_pins {
            self.make_room(ttl, now);
        }
        self.pinned.insert(
            client,
            Pin {
                endpoint,
                last_used: now,
            },
        );
        self.sweep(ttl, now);
        Some(endpoint)
    }

    fn round_robin(&mut self) -> SocketAddr {
        let endpoint = self.endpoints[self.next];
        self.next = (self.next + 1) % self.endpoints.len();
        endpoint
    }

    /// Drops expired pins once the map has doubled since the last sweep.
    fn sweep(&mut self, ttl: Duration, now: Instant) {
        if self.pinned.len() < 2 * self.swept_at + 64 {
            return;
        }
        self.pinned
            .retain(|_, p| now.saturating_duration_since(p.last_used) < ttl);
        self.swept_at = self.pinned.len();
    }

    /// At the pin limit: drops the expired pins, and if that is not enough, the least recently used eighth
    /// (O(pins) once per eighth of the limit inserted: amortised O(1) per new client).
    fn make_room(&mut self, ttl: Duration, now: Instant) {
        self.pinned
            .retain(|_, p| now.saturating_duration_since(p.last_used) < ttl);
        if self.pinned.len() < self.max_pins {
            return;
        }
        let evict = (self.max_pins / 8).max(1);
        let mut by_age: Vec<(Instant, IpAddr)> =
            self.pinned.iter().map(|(c, p)| (p.last_used, *c)).collect();
        by_age.select_nth_unstable(evict - 1);
        for (_, client) in &by_age[..evict] {
            self.pinned.remove(client);
        }
        self.swept_at = self.pinned.len();
    }

    #[cfg(test)]
    /// Pins currently held (expired ones not yet swept included).
    pub(crate) fn pinned_clients(&self) -> usize {
        self.pinned.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ep(i: u8) -> SocketAddr {
        SocketAddr::from(([10, 0, 0, i], 80))
    }
    fn client(i: u8) -> IpAddr {
        IpAddr::from([192, 168, 0, i])
    }

    #[test]
    fn round_robin_visits_every_endpoint_in_turn() {
        let mut b = Balancer::new(None);
        let now = Instant::now();
        assert_eq!(b.pick(client(1), false, now), None);
        b.set_endpoints(vec![ep(1), ep(2), ep(3)]);
        let picks: Vec<_> = (0..6)
            .map(|_| b.pick(client(1), false, now).unwrap())
            .collect();
        assert_eq!(picks, vec![ep(1), ep(2), ep(3), ep(1), ep(2), ep(3)]);
        assert_eq!(b.pinned_clients(), 0);
    }

    #[test]
    fn affinity_sticks_until_the_timeout_then_moves_on() {
        let ttl = Duration::from_secs(10);
        let mut b = Balancer::new(Some(ttl));
        b.set_endpoints(vec![ep(1), ep(2)]);
        let t0 = Instant::now();
        assert_eq!(b.pick(client(1), false, t0), Some(ep(1)));
        assert_eq!(b.pick(client(2), false, t0), Some(ep(2)));
        // Each use refreshes the pin: 9 s apart, five times, stays pinned well past 10 s from the start.
        for k in 1..=5 {
            let t = t0 + Duration::from_secs(9 * k);
            assert_eq!(b.pick(client(1), false, t), Some(ep(1)));
        }
        // Silent for the whole timeout: the pin has expired and round robin resumes.
        let later = t0 + Duration::from_secs(45) + ttl;
        assert_eq!(b.pick(client(1), false, later), Some(ep(1)));
        assert_eq!(b.pick(client(2), false, later), Some(ep(2)));
        let much_later = later + ttl;
        assert_eq!(b.pick(client(2), false, much_later), Some(ep(1)));
    }

    #[test]
    fn a_failed_dial_resets_the_pin_to_the_next_endpoint() {
        let mut b = Balancer::new(Some(Duration::from_secs(60)));
        b.set_endpoints(vec![ep(1), ep(2), ep(3)]);
        let now = Instant::now();
        assert_eq!(b.pick(client(1), false, now), Some(ep(1)));
        assert_eq!(b.pick(client(1), true, now), Some(ep(2)));
        // The new choice is the pin from now on.
        assert_eq!(b.pick(client(1), false, now), Some(ep(2)));
    }

    #[test]
    fn endpoint_changes_keep_pins_to_remaining_endpoints_only() {
        let mut b = Balancer::new(Some(Duration::from_secs(60)));
        b.set_endpoints(vec![ep(1), ep(2), ep(3)]);
        let now = Instant::now();
        assert_eq!(b.pick(client(1), false, now), Some(ep(1)));
        assert_eq!(b.pick(client(2), false, now), Some(ep(2)));
        assert_eq!(b.pick(client(3), false, now), Some(ep(3)));
        b.set_endpoints(vec![ep(1), ep(3), ep(4)]);
        assert_eq!(b.pick(client(1), false, now), Some(ep(1)));
        assert_eq!(b.pick(client(3), false, now), Some(ep(3)));
        // Client 2's endpoint left: it is balanced afresh, onto an endpoint of the new list.
        let moved = b.pick(client(2), false, now).unwrap();
        assert!([ep(1), ep(3), ep(4)].contains(&moved));
        assert_ne!(moved, ep(2));
        b.set_endpoints(vec![]);
        assert_eq!(b.pick(client(1), false, now), None);
        assert_eq!(b.pinned_clients(), 0);
    }

    #[test]
    fn turning_affinity_off_forgets_every_pin() {
        let mut b = Balancer::new(Some(Duration::from_secs(60)));
        b.set_endpoints(vec![ep(1), ep(2)]);
        let now = Instant::now();
        b.pick(client(1), false, now);
        b.set_affinity(None);
        assert_eq!(b.pinned_clients(), 0);
        assert_eq!(b.pick(client(1), false, now), Some(ep(2)));
        assert_eq!(b.pick(client(1), false, now), Some(ep(1)));
    }

    #[test]
    fn pins_are_bounded_and_the_least_recently_used_go_first() {
        let mut b = Balancer::with_max_pins(Some(Duration::from_secs(3600)), 16);
        b.set_endpoints(vec![ep(1), ep(2)]);
        let t0 = Instant::now();
        // Client 1 first, and it keeps coming back between the others.
        assert_eq!(b.pick(client(1), false, t0), Some(ep(1)));
        for i in 2..=200u8 {
            let t = t0 + Duration::from_millis(u64::from(i));
            b.pick(client(i), false, t);
            assert!(b.pinned_clients() <= 16, "{}", b.pinned_clients());
            assert_eq!(
                b.pick(client(1), false, t),
                Some(ep(1)),
                "client 1 lost its pin at {i}"
            );
        }
    }

    #[test]
    fn expired_pins_are_swept_so_the_map_stays_bounded() {
        let ttl = Duration::from_secs(1);
        let mut b = Balancer::new(Some(ttl));
        b.set_endpoints(vec![ep(1)]);
        let t0 = Instant::now();
        for round in 0..50u32 {
            let t = t0 + ttl * (round * 2);
            for i in 0..100u32 {
                let c = IpAddr::from((round * 1000 + i).to_be_bytes());
                b.pick(c, false, t);
            }
        }
        // 5000 clients came, never more than two rounds' worth (plus the sweep's slack) are held.
        assert!(
            b.pinned_clients() <= 2 * 100 + 64 + 100,
            "{}",
            b.pinned_clients()
        );
    }
}
