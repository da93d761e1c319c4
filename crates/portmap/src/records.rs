//! The plugin's record of the attachments it mapped, kept beside the kernel for one purpose: putting their
//! mappings back after a firewall reload deleted the plugin's tables (`nftkube-portmap restore`). The kernel
//! stays the record for every command; a flush leaves nothing there to read back, so the configuration each
//! ADD succeeded with is kept in a file until the attachment's DEL or GC.
//!
//! Files live under `/run/nftkube-portmap/` (memory: a reboot, which empties the kernel too, empties it as
//! well, and runtimes ADD their containers again), in a directory per network namespace (its device and inode,
//! as `ip netns identify` tells namespaces apart), one per network, one file per attachment:
//! `NETWORK/CONTAINERID:IFNAME.json` (`:` is in neither).
//!
//! ADD, DEL, GC and restore hold one exclusive lock on the namespace's directory from their read of the
//! kernel to the record's update, so a restore never runs between a DEL's commit and the removal of its
//! record, nor replays an ADD whose commit is not done: it brings back exactly the attachments whose last
//! command was a successful ADD.

use super::cni::{code, Attachment, CniError};
use std::fs::File;
use std::os::unix::fs::{DirBuilderExt, MetadataExt};
use std::path::{Path, PathBuf};

/// Where the records of every namespace are.
const ROOT: &str = "/run/nftkube-portmap";

/// The records of this process's network namespace, locked for as long as the value lives.
pub(crate) struct Records {
    dir: PathBuf,
    /// Held for its lock: released when dropped (or when the process exits, whatever happens).
    _lock: File,
}

/// One attachment's record: who, and the configuration its ADD succeeded with.
pub(crate) struct Record {
    /// The attachment.
    pub(crate) attachment: Attachment,
    /// The ADD's stdin, as it came.
    pub(crate) config: Vec<u8>,
    /// The file, for errors.
    pub(crate) path: PathBuf,
}

fn io(what: String, e: std::io::Error) -> CniError {
    CniError::new(code::IO_FAILURE, what).with_details(e.to_string())
}

/// This network namespace's directory of records.
fn namespace_dir() -> Result<PathBuf, CniError> {
    let ns = std::fs::metadata("/proc/self/ns/net")
        .map_err(|e| io("identifying the network namespace".into(), e))?;
    Ok(Path::new(ROOT).join(format!("netns-{}-{}", ns.dev(), ns.ino())))
}

/// Whether the plugin ever recorded anything in this network namespace (nothing is created to find out).
pub(crate) fn any() -> bool {
    namespace_dir().is_ok_and(|d| d.is_dir())
}

impl Records {
    /// Opens (creating it) this namespace's directory and waits for its lock.
    pub(crate) fn lock() -> Result<Records, CniError> {
        let dir = namespace_dir()?;
        // Root's alone: the records hold the runtimes' configurations.
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(&dir)
            .map_err(|e| io(format!("creating {}", dir.display()), e))?;
        let path = dir.join("lock");
        let lock = File::create(&path).map_err(|e| io(format!("opening {}", path.display()), e))?;
        lock.lock()
            .map_err(|e| io(format!("locking {}", path.display()), e))?;
        Ok(Records { dir, _lock: lock })
    }

    fn file(&self, network: &str, a: &Attachment) -> PathBuf {
        self.dir
            .join(network)
            .join(format!("{}:{}.json", a.container_id, a.ifname))
    }

    /// Records that `a`'s ADD on `network` succeeded with `config` (written whole, then renamed in place).
    pub(crate) fn write(
        &self,
        network: &str,
        a: &Attachment,
        config: &[u8],
    ) -> Result<(), CniError> {
        let path = self.file(network, a);
        let tmp = path.with_extension("tmp");
        let dir = self.dir.join(network);
        std::fs::create_dir_all(&dir)
            .and_then(|()| std::fs::write(&tmp, config))
            .and_then(|()| std::fs::rename(&tmp, &path))
            .map_err(|e| io(format!("recording the mappings in {}", path.display()), e))
    }

    /// Forgets `a` on `network` (nothing to do when it has no record).
    pub(crate) fn remove(&self, network: &str, a: &Attachment) -> Result<(), CniError> {
        let path = self.file(network, a);
        match std::fs::remove_file(&path) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                Err(io(format!("removing {}", path.display()), e))
            }
            _ => Ok(()),
        }
    }

    /// Every record of `network`, or of every network when None.
    pub(crate) fn list(&self, network: Option<&str>) -> Result<Vec<Record>, CniError> {
        let networks: Vec<PathBuf> = match network {
            Some(n) => vec![self.dir.join(n)],
            None => entries(&self.dir)?
                .into_iter()
                .filter(|p| p.is_dir())
                .collect(),
        };
        let mut out = Vec::new();
        for dir in networks {
            for path in entries(&dir)? {
                if let Some(attachment) = attachment_of(&path) {
                    let config = std::fs::read(&path)
                        .map_err(|e| io(format!("reading {}", path.display()), e))?;
                    out.push(Record {
                        attachment,
                        config,
                        path,
                    });
                }
            }
        }
        Ok(out)
    }
}

/// A directory's entries; none when it does not exist.
fn entries(dir: &Path) -> Result<Vec<PathBuf>, CniError> {
    let read = match std::fs::read_dir(dir) {
        Ok(r) => r,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(io(format!("listing {}", dir.display()), e)),
    };
    let mut out = Vec::new();
    for entry in read {
        out.push(
            entry
                .map_err(|e| io(format!("listing {}", dir.display()), e))?
                .path(),
        );
    }
    out.sort();
    Ok(out)
}

/// The attachment a record's file name names (`CONTAINERID:IFNAME.json`); None for anything else.
fn attachment_of(path: &Path) -> Option<Attachment> {
    let name = path.file_name()?.to_str()?.strip_suffix(".json")?;
    let (id, ifname) = name.split_once(':')?;
    (!id.is_empty() && !ifname.is_empty()).then(|| Attachment {
        container_id: id.to_owned(),
        ifname: ifname.to_owned(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn file_names_round_trip_and_others_are_ignored() {
        let a = attachment_of(Path::new("/x/net/abc-1:eth0.json")).unwrap();
        assert_eq!(
            (a.container_id.as_str(), a.ifname.as_str()),
            ("abc-1", "eth0")
        );
        for other in [
            "/x/net/lock",
            "/x/net/abc:eth0.tmp",
            "/x/net/:eth0.json",
            "/x/net/abc.json",
        ] {
            assert!(attachment_of(Path::new(other)).is_none(), "{other}");
        }
    }
}
