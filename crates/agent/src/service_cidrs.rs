//! The service CIDRs the data path drops unallocated addresses in: `--service-cidr` and the API's
//! ServiceCIDR objects together. A change of them is committed on its own (`SyncEngine::sync_skeleton`):
//! only the `cluster-ips-check` chains change, no service is rendered again and nothing is read back.

use nftkube_model::Cidr;
use nftkube_render::RenderConfig;
use nftkube_sync::{SyncEngine, SyncError};

/// `--service-cidr` ∪ the ServiceCIDRs' CIDRs, sorted, without duplicates.
pub(crate) fn effective(flag: &[Cidr], api: &[Cidr]) -> Vec<Cidr> {
    let mut all: Vec<Cidr> = flag.iter().chain(api).copied().collect();
    all.sort();
    all.dedup();
    all
}

/// Commits the skeleton of `cfg` alone. Whatever it cannot do (memory not trusted, the kernel refusing)
/// is left to a full sync, which is then due.
pub(crate) fn commit<B: nftkube_nft::Backend>(engine: &mut SyncEngine<B>, cfg: &RenderConfig) {
    if engine.needs_full_sync() {
        return; // the full sync about to run commits the new checks with everything else
    }
    match engine.sync_skeleton(nftkube_render::skeleton(cfg)) {
        Ok(report) => tracing::info!(
            service_cidrs = ?cfg.service_cidrs,
            changes = report.changes,
            bytes = report.bytes,
            commit_ms = report.commit_time.as_secs_f64() * 1000.0,
            "unallocated service addresses: checks updated, services untouched"
        ),
        Err(e) => {
            if !matches!(e, SyncError::NeedsFullSync) {
                tracing::warn!("updating the service CIDR checks failed; a full sync follows: {e}");
            }
            engine.force_full_sync();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_flag_and_the_api_are_merged() {
        let cidrs = |s: &str| nftkube_model::parse_cidrs(s).unwrap();
        let got = effective(
            &cidrs("10.96.0.0/16,fd00::/112"),
            &cidrs("10.96.0.0/16,10.0.0.0/24"),
        );
        assert_eq!(got, cidrs("10.0.0.0/24,10.96.0.0/16,fd00::/112"));
        assert_eq!(effective(&[], &[]), Vec::new());
    }
}
