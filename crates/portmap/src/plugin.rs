//! The commands: ADD, DEL, CHECK, VERSION, GC and STATUS, each one read of the kernel, one plan, and at most
//! one netlink batch.

use super::cni::{self, code, Attachment, CniError, Command, Env};
use super::flows::{self, HostPort};
use super::netconf::{self, NetConf, Protocol};
use super::render::{self, Names, Wanted, FAMILIES};
use super::state::{self, NetworkView, Removed};
use nftkube_nft::ir::{Element, Family};
use nftkube_nft::netlink::NftSocket;
use nftkube_nft::tx::Transaction;
use std::collections::BTreeSet;

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
    let conf = netconf::parse(stdin)?;
    let attachment = || env.attachment.clone().expect("read_env requires it");
    match env.command {
        Command::Add => add(&conf, &attachment()),
        Command::Del => del(&conf, &attachment()).map(|()| String::new()),
        Command::Check => check(&conf, &attachment()).map(|()| String::new()),
        Command::Gc => gc(&conf).map(|()| String::new()),
        Command::Status => status().map(|()| String::new()),
        Command::Version => unreachable!(),
    }
}

/// How many times a command reads, plans and commits again when a concurrent invocation changed the same
/// objects in between (the kernel then refuses the batch, and nothing of it is applied).
const ATTEMPTS: usize = 5;

fn open() -> Result<NftSocket, CniError> {
    NftSocket::open().map_err(|e| {
        CniError::new(code::IO_FAILURE, "opening an nf_tables netlink socket")
            .with_details(e.to_string())
    })
}

fn read(sock: &mut NftSocket, family: Family, names: &Names) -> Result<NetworkView, CniError> {
    state::read(sock, family, names).map_err(|e| {
        CniError::new(
            code::IO_FAILURE,
            format!("reading table {} {}", family.as_str(), render::TABLE),
        )
        .with_details(e.to_string())
    })
}

/// Reads, plans with `plan` and commits, again while concurrent changes make the batch fail.
fn transact(
    names: &Names,
    mut plan: impl FnMut(&mut Transaction, Family, &NetworkView) -> Result<Removed, CniError>,
) -> Result<Vec<(Family, Removed)>, CniError> {
    let mut sock = open()?;
    let mut last = None;
    for _ in 0..ATTEMPTS {
        let mut tx = Transaction::default();
        let mut removed = Vec::new();
        for family in FAMILIES {
            let view = read(&mut sock, family, names)?;
            removed.push((family, plan(&mut tx, family, &view)?));
        }
        match sock.commit(&tx) {
            Ok(_) => return Ok(removed),
            Err(e)
                if e.errno()
                    .is_some_and(|n| [libc::EEXIST, libc::ENOENT, libc::EBUSY].contains(&n)) =>
            {
                last = Some(e);
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

fn add(conf: &NetConf, a: &Attachment) -> Result<String, CniError> {
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
    let removed = transact(&names, |tx, family, view| {
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

fn del(conf: &NetConf, a: &Attachment) -> Result<(), CniError> {
    let names = Names::of(&conf.name);
    let owner = render::owner_comment(&a.container_id, &a.ifname);
    let removed = transact(&names, |tx, family, view| {
        Ok(state::remove_where(tx, family, view, &names, |c| {
            c == Some(owner.as_str())
        }))
    })?;
    clear_flows(&udp_ports(&names, &removed));
    Ok(())
}

fn check(conf: &NetConf, a: &Attachment) -> Result<(), CniError> {
    if conf.prev_result.is_none() {
        return Err(CniError::new(code::INVALID_CONFIG, "prevResult: missing"));
    }
    let names = Names::of(&conf.name);
    let owner = render::owner_comment(&a.container_id, &a.ifname);
    let mut sock = open()?;
    let mut problems = Vec::new();
    for family in FAMILIES {
        let view = read(&mut sock, family, &names)?;
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

fn gc(conf: &NetConf) -> Result<(), CniError> {
    let valid: BTreeSet<(String, String)> = conf
        .valid_attachments
        .as_ref()
        .ok_or_else(|| CniError::new(code::INVALID_CONFIG, "cni.dev/valid-attachments: missing"))?
        .iter()
        .map(|a| (a.container_id.clone(), a.ifname.clone()))
        .collect();
    let names = Names::of(&conf.name);
    let removed = transact(&names, |tx, family, view| {
        // Only elements this plugin wrote (its comment format) and no valid attachment owns.
        let doomed = |c: Option<&str>| {
            c.and_then(render::parse_owner)
                .is_some_and(|(id, ifname)| !valid.contains(&(id.to_owned(), ifname.to_owned())))
        };
        Ok(state::remove_where(tx, family, view, &names, doomed))
    })?;
    clear_flows(&udp_ports(&names, &removed));
    Ok(())
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
