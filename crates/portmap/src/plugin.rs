//! The commands: ADD, DEL, CHECK, VERSION, GC and STATUS, each one read of the kernel, one plan, and at most
//! one netlink batch.

use super::cni::{self, code, Attachment, CniError, Command, Env};
use super::flows::{self, HostPort};
use super::kernel::Kernel;
use super::netconf::{self, NetConf, Protocol};
use super::records::Records;
use super::render::{self, Names, Wanted, FAMILIES};
use super::state::{self, NetworkView, Removed};
use nftkube_nft::ir::{Element, Family};
use nftkube_nft::netlink::NftSocket;
use nftkube_nft::tx::Transaction;
use std::collections::BTreeSet;
use std::path::Path;

/// What an invocation prints on stdout and whether it succeeded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Outcome {
    /// What to print on stdout.
    pub(crate) stdout: String,
    /// Whether the command succeeded (the exit code).
    pub(crate) ok: bool,
}

/// Runs one invocation: the CNI variables through `env`, the configuration from `stdin`.
pub(crate) fn run(env: impl Fn(&str) -> Option<String>, stdin: &[u8]) -> Outcome {
    // The version errors are reported in: the configuration's when it says one.
    let version = serde_json::from_slice::<serde_json::Value>(stdin)
        .ok()
        .and_then(|v| v.get("cniVersion")?.as_str().map(str::to_owned))
        .filter(|v| cni::SUPPORTED_VERSIONS.contains(&v.as_str()))
        .unwrap_or_else(|| cni::CURRENT_VERSION.to_owned());
    match cni::read_env(env).and_then(|env| dispatch(&env, stdin)) {
        Ok(stdout) => Outcome { stdout, ok: true },
        Err(e) => Outcome {
            stdout: e.to_json(&version),
            ok: false,
        },
    }
}

fn dispatch(env: &Env, stdin: &[u8]) -> Result<String, CniError> {
    if env.command == Command::Version {
        return Ok(cni::version_info());
    }
    let attachment = || env.attachment.clone().expect("read_env requires it");
    // DEL and GC read only what they need: see `netconf::Removal`.
    if matches!(env.command, Command::Del | Command::Gc) {
        let conf = netconf::parse_removal(stdin, env.command == Command::Gc)?;
        let Some(name) = &conf.name else {
            // No network ADD accepts, so nothing of it to remove.
            return Ok(String::new());
        };
        let names = Names::of(name);
        let records = Records::lock()?;
        let mut sock = open()?;
        if env.command == Command::Del {
            del(&mut sock, &names, &attachment())?;
            records.remove(name, &attachment())?;
        } else {
            let valid = conf.valid_attachments.as_deref();
            gc(&mut sock, &names, valid)?;
            forget_invalid(&records, name, valid.unwrap_or_default())?;
        }
        return Ok(String::new());
    }
    let conf = netconf::parse(stdin)?;
    match env.command {
        Command::Add => {
            let records = Records::lock()?;
            let result = add(&mut open()?, &conf, &attachment())?;
            if !conf.port_mappings.is_empty() {
                records.write(&conf.name, &attachment(), stdin)?;
            }
            Ok(result)
        }
        Command::Check => check(&mut open()?, &conf, &attachment()).map(|()| String::new()),
        Command::Status => status().map(|()| String::new()),
        Command::Version | Command::Del | Command::Gc => unreachable!("answered above"),
    }
}

/// How many times a command reads, plans and commits: again whenever anyone committed between its read and
/// its commit (the kernel then refuses the whole batch). Each lost round means another invocation (or the
/// agent) committed, so the bound only trips under a storm of commits: it covers dozens of pods started at
/// once on one node.
const ATTEMPTS: u32 = 40;

fn open() -> Result<NftSocket, CniError> {
    NftSocket::open().map_err(|e| {
        CniError::new(code::IO_FAILURE, "opening an nf_tables netlink socket")
            .with_details(e.to_string())
    })
}

fn read(k: &mut impl Kernel, family: Family, names: &Names) -> Result<NetworkView, CniError> {
    state::read(k, family, names).map_err(|e| {
        CniError::new(
            code::IO_FAILURE,
            format!("reading table {} {}", family.as_str(), render::TABLE),
        )
        .with_details(e.to_string())
    })
}

/// Reads, plans with `plan` and commits, checked against the generation the read saw: the plan deletes by
/// key what it chose by comment, and a key another invocation took over since (a replaced pod's hostPort
/// given to the new pod) must not be deleted. When anyone committed in between, the kernel refuses the
/// whole batch (ERESTART) and the command reads and plans again.
fn transact(
    k: &mut impl Kernel,
    names: &Names,
    mut plan: impl FnMut(&mut Transaction, Family, &NetworkView) -> Result<Removed, CniError>,
) -> Result<Vec<(Family, Removed)>, CniError> {
    let mut last = None;
    for attempt in 0..ATTEMPTS {
        let generation = k.generation().map_err(|e| {
            CniError::new(code::IO_FAILURE, "reading the nf_tables generation")
                .with_details(e.to_string())
        })?;
        let mut tx = Transaction::default();
        let mut removed = Vec::new();
        for family in FAMILIES {
            let view = read(k, family, names)?;
            removed.push((family, plan(&mut tx, family, &view)?));
        }
        match k.commit_at(&tx, generation) {
            Ok(_) => return Ok(removed),
            Err(e) if lost_a_race(&e) => {
                last = Some(e);
                back_off(attempt);
            }
            Err(e) => {
                return Err(
                    CniError::new(code::IO_FAILURE, "the kernel refused the port mappings")
                        .with_details(e.to_string()),
                )
            }
        }
    }
    Err(CniError::new(
        code::TRY_AGAIN_LATER,
        "the port mapping tables kept changing under this invocation",
    )
    .with_details(last.map(|e| e.to_string()).unwrap_or_default()))
}

/// Whether the batch was refused because the ruleset moved under it: the generation changed (ERESTART), or,
/// for a kernel that ignored the generation, an object another invocation created or deleted meanwhile.
fn lost_a_race(e: &nftkube_nft::netlink::CommitError) -> bool {
    e.errno()
        .is_some_and(|n| [libc::ERESTART, libc::EEXIST, libc::ENOENT, libc::EBUSY].contains(&n))
}

/// A short pause before the next round, growing with the rounds lost and spread by process id, so that
/// invocations that keep refusing each other's batches fall out of step: 0.05 to 0.8 ms a round, some 30 ms
/// if every round is lost.
fn back_off(attempt: u32) {
    let spread = std::process::id() % 7;
    let micros = 50 * u64::from(attempt.min(10) + spread);
    std::thread::sleep(std::time::Duration::from_micros(micros));
}

/// The elements an attachment wants in `family`.
fn wanted(conf: &NetConf, names: &Names, family: Family, owner: &str) -> Vec<Wanted> {
    let Some(ip) = conf
        .prev_result
        .as_ref()
        .and_then(|p| p.container_ip(family))
    else {
        return Vec::new();
    };
    render::elements(family, names, &conf.port_mappings, ip, owner)
}

fn add(k: &mut impl Kernel, conf: &NetConf, a: &Attachment) -> Result<String, CniError> {
    let prev = conf.prev_result.as_ref().ok_or_else(|| {
        CniError::new(
            code::INVALID_CONFIG,
            "prevResult: missing (portmap runs chained after an interface plugin such as bridge or ptp)",
        )
    })?;
    let result = cni::convert_result(&prev.raw, &conf.cni_version).to_string();
    if conf.port_mappings.is_empty() {
        return Ok(result);
    }
    // Before the mappings, not after: ADD fails whole when the sysctl cannot be written (a read-only
    // /proc/sys, an interface gone), and a failed ADD must leave no mapping behind (whether the runtime
    // calls DEL after it is up to the runtime). Not undone if the commit then fails: a concurrent ADD on
    // the same bridge may rely on it already.
    if conf.snat && prev.container_ip(Family::Ip).is_some() {
        enable_localnet_routing(&prev.host_interfaces)?;
    }
    let names = Names::of(&conf.name);
    let owner = render::owner_comment(&a.container_id, &a.ifname);
    let removed = transact(k, &names, |tx, family, view| {
        let want = wanted(conf, &names, family, &owner);
        if !want.is_empty() {
            let subnet = prev.container_subnet(family);
            state::ensure_structure(tx, family, view, &names, conf, subnet);
        }
        Ok(state::converge(tx, family, view, &names, &want, &owner))
    })?;
    // Every UDP port published now, and every one given up (a changed configuration): stale either way.
    let mut udp: Vec<HostPort> = conf
        .port_mappings
        .iter()
        .filter(|m| m.protocol == Protocol::Udp)
        .flat_map(|m| {
            FAMILIES
                .into_iter()
                .filter(|f| m.applies_to(*f) && prev.container_ip(*f).is_some())
                .map(|f| HostPort {
                    v6: f == Family::Ip6,
                    host_ip: m.host_ip,
                    port: m.host_port,
                })
        })
        .collect();
    udp.extend(udp_ports(&names, &removed));
    clear_flows(&udp);
    Ok(result)
}

fn del(k: &mut impl Kernel, names: &Names, a: &Attachment) -> Result<(), CniError> {
    let owner = render::owner_comment(&a.container_id, &a.ifname);
    let removed = transact(k, names, |tx, family, view| {
        Ok(state::remove_where(tx, family, view, names, |c| {
            c == Some(owner.as_str())
        }))
    })?;
    clear_flows(&udp_ports(names, &removed));
    Ok(())
}

fn check(k: &mut impl Kernel, conf: &NetConf, a: &Attachment) -> Result<(), CniError> {
    if conf.prev_result.is_none() {
        return Err(CniError::new(code::INVALID_CONFIG, "prevResult: missing"));
    }
    let names = Names::of(&conf.name);
    let owner = render::owner_comment(&a.container_id, &a.ifname);
    let mut problems = Vec::new();
    for family in FAMILIES {
        let view = read(k, family, &names)?;
        let want = wanted(conf, &names, family, &owner);
        let subnet = conf
            .prev_result
            .as_ref()
            .and_then(|p| p.container_subnet(family));
        problems.extend(state::differences(
            family, &view, &names, conf, subnet, &want, &owner,
        ));
    }
    if problems.is_empty() {
        return Ok(());
    }
    Err(CniError::new(
        code::CHECK_FAILED,
        format!(
            "port mappings of {} on network {}: {}",
            a.container_id, conf.name, problems[0]
        ),
    )
    .with_details(problems.join("; ")))
}

fn gc(k: &mut impl Kernel, names: &Names, valid: Option<&[Attachment]>) -> Result<(), CniError> {
    let valid: BTreeSet<(String, String)> = valid
        .ok_or_else(|| CniError::new(code::INVALID_CONFIG, "cni.dev/valid-attachments: missing"))?
        .iter()
        .map(|a| (a.container_id.clone(), a.ifname.clone()))
        .collect();
    let removed = transact(k, names, |tx, family, view| {
        // Only elements this plugin wrote (its comment format) and no valid attachment owns.
        let doomed = |c: Option<&str>| {
            c.and_then(render::parse_owner)
                .is_some_and(|(id, ifname)| !valid.contains(&(id.to_owned(), ifname.to_owned())))
        };
        Ok(state::remove_where(tx, family, view, names, doomed))
    })?;
    clear_flows(&udp_ports(names, &removed));
    Ok(())
}

/// GC: forgets the records of `network` that no valid attachment owns.
fn forget_invalid(records: &Records, network: &str, valid: &[Attachment]) -> Result<(), CniError> {
    for r in records.list(Some(network))? {
        if !valid.contains(&r.attachment) {
            records.remove(network, &r.attachment)?;
        }
    }
    Ok(())
}

/// `nftkube-portmap restore`: ADDs again, from its record, every attachment of this network namespace whose
/// last command was a successful ADD (after a firewall reload deleted the tables; a no-op while they are
/// intact). Returns how many were restored, or what failed (the others are restored all the same).
pub(crate) fn restore() -> Result<usize, Vec<String>> {
    let records = Records::lock().map_err(|e| vec![e.msg])?;
    let mut sock = open().map_err(|e| vec![e.msg])?;
    let mut failed = Vec::new();
    let mut restored = 0;
    for r in records.list(None).map_err(|e| vec![e.msg])? {
        if container_gone(&r.config) {
            // Its DEL never came (or the namespace that recorded it died, and this one took its number):
            // restoring it would map ports to an address another container may hold now.
            if let Some(network) = r.path.parent().and_then(|d| d.file_name()?.to_str()) {
                if let Err(e) = records.remove(network, &r.attachment) {
                    failed.push(format!("{}: {} {}", r.path.display(), e.msg, e.details));
                }
            }
            continue;
        }
        match netconf::parse(&r.config).and_then(|conf| add(&mut sock, &conf, &r.attachment)) {
            Ok(_) => restored += 1,
            Err(e) => failed.push(format!("{}: {} {}", r.path.display(), e.msg, e.details)),
        }
    }
    if failed.is_empty() {
        Ok(restored)
    } else {
        Err(failed)
    }
}

/// Whether a recorded ADD's container is gone: its previous result names the container's network
/// namespace (`interfaces[].sandbox`, as runtimes and interface plugins fill it in) and none of those paths
/// exists any more. A record that names none is kept: nothing says it is stale.
fn container_gone(config: &[u8]) -> bool {
    let Ok(v) = serde_json::from_slice::<serde_json::Value>(config) else {
        return false;
    };
    let sandboxes: Vec<&str> = v["prevResult"]["interfaces"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|i| i["sandbox"].as_str())
        .filter(|s| !s.is_empty())
        .collect();
    !sandboxes.is_empty() && sandboxes.iter().all(|s| !Path::new(s).exists())
}

/// STATUS: whether nf_tables answers here and this process may change it.
fn status() -> Result<(), CniError> {
    let unavailable = |msg: &str, details: String| {
        Err(CniError::new(code::NOT_AVAILABLE, msg.to_owned()).with_details(details))
    };
    let mut sock = match NftSocket::open() {
        Ok(s) => s,
        Err(e) => return unavailable("nf_tables: cannot open a netlink socket", e.to_string()),
    };
    if let Err(e) = sock.generation() {
        return unavailable("nf_tables: the kernel does not answer", e.to_string());
    }
    match has_net_admin() {
        Ok(true) => Ok(()),
        Ok(false) => unavailable(
            "nf_tables: this process lacks CAP_NET_ADMIN",
            "the plugin must run as root or with CAP_NET_ADMIN".into(),
        ),
        Err(e) => unavailable("reading /proc/self/status", e.to_string()),
    }
}

/// Whether CAP_NET_ADMIN (12) is in the effective set.
fn has_net_admin() -> std::io::Result<bool> {
    let status = std::fs::read_to_string("/proc/self/status")?;
    let eff = status
        .lines()
        .find_map(|l| l.strip_prefix("CapEff:"))
        .and_then(|v| u64::from_str_radix(v.trim(), 16).ok())
        .ok_or_else(|| std::io::Error::other("no CapEff line"))?;
    Ok(eff & (1 << 12) != 0)
}

/// UDP ports that removed `ports`/`hostip` elements published.
fn udp_ports(names: &Names, removed: &[(Family, Removed)]) -> Vec<HostPort> {
    let mut out = Vec::new();
    for (family, list) in removed {
        for (set, e) in list {
            let e: &Element = e;
            if let Some((host_ip, proto, port)) = render::published(*family, names, set, &e.key) {
                if proto == Protocol::Udp.number() {
                    out.push(HostPort {
                        v6: *family == Family::Ip6,
                        host_ip,
                        port,
                    });
                }
            }
        }
    }
    out
}

/// Conntrack cleanup is best effort: the mappings are committed, and a failure here only delays a UDP client
/// until its entry times out. Said on stderr, where runtimes log plugin output.
fn clear_flows(ports: &[HostPort]) {
    let mut ports = ports.to_vec();
    ports.sort();
    ports.dedup();
    if let Err(e) = flows::clear(&ports) {
        use std::io::Write as _;
        let _ = writeln!(
            std::io::stderr(),
            "nftkube portmap: UDP conntrack cleanup: {e}"
        );
    }
}

/// 127.0.0.1 → container needs the node to route packets with a loopback source out of the interface that
/// leads to the container: `route_localnet` on the node-side interfaces of the previous result (upstream sets
/// it on the bridge or host veth the same way). Written through /proc/sys, no binary.
fn enable_localnet_routing(interfaces: &[String]) -> Result<(), CniError> {
    for ifname in interfaces {
        let path = format!("/proc/sys/net/ipv4/conf/{ifname}/route_localnet");
        if std::fs::read_to_string(&path).is_ok_and(|v| v.trim() == "1") {
            continue;
        }
        std::fs::write(&path, "1").map_err(|e| {
            CniError::new(code::IO_FAILURE, format!("setting {path} to 1"))
                .with_details(e.to_string())
        })?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use nftkube_nft::fake::FakeKernel;
    use serde_json::json;

    /// A record is stale when the container's network namespace its previous result names is gone; one that
    /// names none, or names one that exists, is restored.
    #[test]
    fn a_record_whose_container_namespace_is_gone_is_not_restored() {
        let with = |sandbox: &str| {
            json!({"prevResult": {"interfaces": [{"name": "cni0"}, {"name": "eth0", "sandbox": sandbox}]}})
                .to_string()
                .into_bytes()
        };
        assert!(container_gone(&with("/nonexistent/netns/pod-1")));
        assert!(!container_gone(&with("/proc/self/ns/net")));
        assert!(!container_gone(
            br#"{"prevResult": {"interfaces": [{"name": "eth0"}]}}"#
        ));
        assert!(!container_gone(b"not json"));
    }

    /// A TCP mapping of host port 8080 to `ip` (snat off: no /proc/sys write in a unit test).
    fn conf(ip: &str) -> NetConf {
        let c = json!({"cniVersion": "1.1.0", "name": "n1", "snat": false,
            "runtimeConfig": {"portMappings": [{"hostPort": 8080, "containerPort": 80, "protocol": "tcp"}]},
            "prevResult": {"interfaces": [{"name": "eth0", "sandbox": "/run/netns/x"}],
                           "ips": [{"address": format!("{ip}/24"), "interface": 0}]}});
        netconf::parse(c.to_string().as_bytes()).unwrap()
    }

    fn attachment(id: &str) -> Attachment {
        Attachment {
            container_id: id.into(),
            ifname: "eth0".into(),
        }
    }

    /// The owner of host port 8080's element in the ports map.
    fn port_owner(k: &FakeKernel) -> Option<String> {
        let ports = k.read_set_commented(Family::Ip, render::TABLE, &Names::of("n1").ports);
        assert!(ports.len() <= 1, "{ports:?}");
        ports.into_iter().next().and_then(|(_, c)| c)
    }

    /// A replaced pod: the old pod's DEL reads its element, the new pod's ADD of the same hostPort commits
    /// (taking the key over), then the DEL commits. Planned from the old read, the DEL would delete the key,
    /// now the new pod's; checked against its generation, it is refused, reads again, and removes only what
    /// is still the old pod's.
    #[test]
    fn a_del_racing_the_replacing_add_keeps_the_new_mapping() {
        let mut k = FakeKernel::default();
        add(&mut k, &conf("10.0.0.2"), &attachment("old")).unwrap();
        let mut other = k.clone();
        add(&mut other, &conf("10.0.0.3"), &attachment("new")).unwrap();
        k.interleave = other.committed.last().cloned();
        let before = k.committed.len();

        del(&mut k, &Names::of("n1"), &attachment("old")).unwrap();

        assert_eq!(port_owner(&k).as_deref(), Some("new eth0"));
        check(&mut k, &conf("10.0.0.3"), &attachment("new")).unwrap();
        let targets = k.read_set_commented(Family::Ip, render::TABLE, &Names::of("n1").targets);
        assert_eq!(
            targets
                .iter()
                .map(|(_, c)| c.as_deref())
                .collect::<Vec<_>>(),
            [Some("new eth0")],
            "the old pod's target element is gone, the new one's kept"
        );
        assert_eq!(
            k.committed.len(),
            before + 2,
            "the competing ADD, then the DEL's second plan (its first was refused)"
        );
    }

    /// Without the generation check the same interleaving loses the new mapping: the plan the check refuses
    /// is the one that deletes the new pod's key.
    #[test]
    fn the_first_del_plan_would_have_deleted_the_new_key() {
        let mut k = FakeKernel::default();
        add(&mut k, &conf("10.0.0.2"), &attachment("old")).unwrap();
        let stale = state::read(&mut k, Family::Ip, &Names::of("n1")).unwrap();
        add(&mut k, &conf("10.0.0.3"), &attachment("new")).unwrap();
        let mut tx = Transaction::default();
        state::remove_where(&mut tx, Family::Ip, &stale, &Names::of("n1"), |c| {
            c == Some("old eth0")
        });
        nftkube_nft::backend::Backend::commit(&mut k, &tx).unwrap();
        assert_eq!(port_owner(&k), None, "the unchecked stale plan deleted it");
    }

    /// Every command's batch is refused while someone commits between its read and its commit, and it
    /// gives up after `ATTEMPTS` rounds, saying so with code 11 (try again later), having changed nothing.
    #[test]
    fn a_command_gives_up_after_the_bound_and_changes_nothing() {
        struct Busy(FakeKernel);
        impl Kernel for Busy {
            fn generation(&mut self) -> Result<u32, nftkube_nft::netlink::DumpError> {
                Ok(self.0.generation)
            }
            fn structure(
                &mut self,
                family: Family,
                table: &str,
            ) -> Result<Option<nftkube_nft::ir::TableState>, nftkube_nft::netlink::DumpError>
            {
                self.0.structure(family, table)
            }
            fn commented(
                &mut self,
                family: Family,
                table: &str,
                set: &str,
            ) -> Result<Vec<state::Read>, nftkube_nft::netlink::DumpError> {
                self.0.commented(family, table, set)
            }
            fn commit_at(
                &mut self,
                tx: &Transaction,
                generation: u32,
            ) -> Result<usize, nftkube_nft::netlink::CommitError> {
                // Someone else commits every time, just before.
                self.0.generation += 1;
                self.0.commit_at(tx, generation)
            }
        }
        let mut k = Busy(FakeKernel::default());
        let e = add(&mut k, &conf("10.0.0.2"), &attachment("a")).unwrap_err();
        assert_eq!(e.code, code::TRY_AGAIN_LATER, "{e:?}");
        assert!(k.0.tables.is_empty() && k.0.committed.is_empty());
    }
}
