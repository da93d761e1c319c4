//! The sync engine: keeps the last committed state in memory, commits the difference to the desired state
//! in one atomic transaction, and re-reads the kernel when it cannot trust its memory (start, errors).

use super::diff::diff_table;
use crate::nft::ir::{Family, TableState};
use crate::nft::netlink::{CommitError, DumpError};
use crate::nft::tx::Transaction;
use crate::nft::Backend;
use std::collections::BTreeMap;
use std::time::{Duration, Instant};

#[derive(Debug, thiserror::Error)]
pub enum SyncError {
    #[error("reading the kernel's tables: {0}")]
    Read(#[from] DumpError),
    #[error(transparent)]
    Commit(#[from] CommitError),
}

/// What one sync did.
#[derive(Debug, Clone, Default)]
pub struct SyncReport {
    /// Whether the kernel was read back first (startup, after an error, or a forced full sync).
    pub full: bool,
    /// Object changes committed (0: the kernel already matched).
    pub changes: usize,
    /// Netlink bytes sent.
    pub bytes: usize,
    pub elapsed: Duration,
}

pub struct SyncEngine<B: Backend> {
    backend: B,
    committed: BTreeMap<(Family, String), Option<TableState>>,
    trust_memory: bool,
}

impl<B: Backend> SyncEngine<B> {
    pub fn new(backend: B) -> Self {
        SyncEngine {
            backend,
            committed: BTreeMap::new(),
            trust_memory: false,
        }
    }

    pub fn backend(&mut self) -> &mut B {
        &mut self.backend
    }

    /// The next sync reads the kernel back and repairs any drift.
    pub fn force_full_sync(&mut self) {
        self.trust_memory = false;
    }

    /// Brings the kernel to `desired`. On failure nothing was applied, and the next sync starts from a fresh
    /// read of the kernel.
    pub fn sync(&mut self, desired: &[TableState]) -> Result<SyncReport, SyncError> {
        let start = Instant::now();
        let full = !self.trust_memory;
        if full {
            for t in desired {
                let current = self.backend.read_table(t.family, &t.name)?;
                self.committed.insert((t.family, t.name.clone()), current);
            }
        }
        let mut tx = Transaction::default();
        for t in desired {
            let old = self
                .committed
                .get(&(t.family, t.name.clone()))
                .and_then(Option::as_ref);
            diff_table(&mut tx, old, t);
        }
        for c in &tx.changes {
            tracing::debug!(full, "{c}");
        }
        let bytes = match self.backend.commit(&tx) {
            Ok(b) => b,
            Err(e) => {
                self.trust_memory = false;
                return Err(e.into());
            }
        };
        for t in desired {
            self.committed
                .insert((t.family, t.name.clone()), Some(t.clone()));
        }
        self.trust_memory = true;
        Ok(SyncReport {
            full,
            changes: tx.changes.len(),
            bytes,
            elapsed: start.elapsed(),
        })
    }
}

/// Deletes the given tables if they exist, in one transaction. Returns how many were deleted.
pub fn delete_tables<B: Backend>(
    backend: &mut B,
    tables: &[(Family, &str)],
) -> Result<usize, SyncError> {
    let mut tx = Transaction::default();
    for (family, name) in tables {
        if backend.read_table(*family, name)?.is_some() {
            tx.push(*family, name, crate::nft::tx::Op::DeleteTable);
        }
    }
    backend.commit(&tx)?;
    Ok(tx.changes.len())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::*;
    use crate::nft::fake::FakeKernel;
    use crate::render::{render, RenderConfig};

    fn service(name: &str, ip: &str, eps: &[&str]) -> (ServicePort, Vec<Endpoint>) {
        let spn = ServicePortName {
            service: NamespacedName::new("ns", name),
            port: String::new(),
            protocol: Protocol::Tcp,
        };
        let sp = ServicePort {
            name: spn,
            service_type: ServiceType::ClusterIP,
            cluster_ips: vec![ip.parse().unwrap()],
            port: 80,
            protocol: Protocol::Tcp,
            node_port: None,
            external_ips: vec![],
            load_balancer_ips: vec![],
            load_balancer_source_ranges: vec![],
            external_traffic_policy: TrafficPolicy::Cluster,
            internal_traffic_policy: TrafficPolicy::Cluster,
            session_affinity_timeout: None,
            health_check_node_port: None,
        };
        let eps = eps
            .iter()
            .map(|e| Endpoint {
                ip: e.parse().unwrap(),
                port: 8080,
                ready: true,
                serving: true,
                terminating: false,
                node_name: None,
                zone: None,
                zone_hints: vec![],
                node_hints: vec![],
            })
            .collect();
        (sp, eps)
    }

    fn world(list: &[(ServicePort, Vec<Endpoint>)]) -> Vec<TableState> {
        let services: ServiceMap = list
            .iter()
            .map(|(s, _)| (s.name.clone(), s.clone()))
            .collect();
        let eps: EndpointsMap = list
            .iter()
            .map(|(s, e)| (s.name.clone(), e.clone()))
            .collect();
        render(&services, &eps, &RenderConfig::default())
    }

    fn kernel_matches(k: &FakeKernel, desired: &[TableState]) {
        for t in desired {
            assert_eq!(k.tables.get(&(t.family, t.name.clone())), Some(t));
        }
    }

    #[test]
    fn first_sync_creates_then_changes_are_minimal() {
        let mut e = SyncEngine::new(FakeKernel::default());
        let a = service("a", "10.96.0.1", &["10.0.0.1", "10.0.0.2"]);
        let b = service("b", "10.96.0.2", &["10.0.0.3"]);
        let d1 = world(&[a.clone(), b.clone()]);
        let r = e.sync(&d1).unwrap();
        assert!(r.full && r.changes > 0);
        kernel_matches(&e.backend, &d1);

        // Nothing changed: nothing sent.
        assert_eq!(e.sync(&d1).unwrap().changes, 0);

        // One endpoint added to b: only b's chain is rewritten plus one hairpin element.
        let b2 = service("b", "10.96.0.2", &["10.0.0.3", "10.0.0.4"]);
        let d2 = world(&[a.clone(), b2]);
        let r = e.sync(&d2).unwrap();
        assert!(!r.full);
        kernel_matches(&e.backend, &d2);
        assert!(r.changes <= 5, "{} changes", r.changes);

        // Service a removed: its chain and map element go away.
        let d3 = world(std::slice::from_ref(&b));
        e.sync(&d3).unwrap();
        kernel_matches(&e.backend, &d3);
    }

    #[test]
    fn failed_commit_keeps_the_old_state_and_rereads_next_time() {
        let mut e = SyncEngine::new(FakeKernel::default());
        let d1 = world(&[service("a", "10.96.0.1", &["10.0.0.1"])]);
        e.sync(&d1).unwrap();
        e.backend.fail_next = Some((0, libc::EINVAL));
        let d2 = world(&[service("a", "10.96.0.1", &["10.0.0.2"])]);
        let err = e.sync(&d2).unwrap_err();
        assert!(err.to_string().contains("Invalid argument"), "{err}");
        kernel_matches(&e.backend, &d1);
        let r = e.sync(&d2).unwrap();
        assert!(r.full);
        kernel_matches(&e.backend, &d2);
    }

    #[test]
    fn drift_is_repaired_on_a_full_sync() {
        let mut e = SyncEngine::new(FakeKernel::default());
        let d = world(&[service("a", "10.96.0.1", &["10.0.0.1"])]);
        e.sync(&d).unwrap();
        // Someone flushes a chain and deletes the ip table's elements behind our back.
        let t = e
            .backend
            .tables
            .get_mut(&(Family::Ip, "nftkube".into()))
            .unwrap();
        t.chains.get_mut("services").unwrap().rules.clear();
        t.sets.get_mut("service-ips").unwrap().elements.clear();
        e.force_full_sync();
        let r = e.sync(&d).unwrap();
        assert!(r.full && r.changes > 0);
        kernel_matches(&e.backend, &d);
        // A table deleted entirely is recreated.
        e.backend.tables.clear();
        e.force_full_sync();
        e.sync(&d).unwrap();
        kernel_matches(&e.backend, &d);
    }

    #[test]
    fn delete_tables_removes_only_ours() {
        let mut k = FakeKernel::default();
        k.tables.insert(
            (Family::Ip, "other".into()),
            TableState::new(Family::Ip, "other"),
        );
        let mut e = SyncEngine::new(k);
        e.sync(&world(&[service("a", "10.96.0.1", &["10.0.0.1"])]))
            .unwrap();
        let n = delete_tables(
            e.backend(),
            &[(Family::Ip, "nftkube"), (Family::Ip6, "nftkube")],
        )
        .unwrap();
        assert_eq!(n, 2);
        assert_eq!(
            e.backend.tables.keys().collect::<Vec<_>>(),
            vec![&(Family::Ip, "other".to_string())]
        );
        assert_eq!(
            delete_tables(e.backend(), &[(Family::Ip, "nftkube")]).unwrap(),
            0
        );
    }
}
