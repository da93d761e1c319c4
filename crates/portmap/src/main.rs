//! `nftkube-portmap`: the CNI portmap plugin alone, the binary a runtime finds in its CNI_PATH (under the name
//! `portmap` or `nftkube-portmap`). It does what `nftkube portmap` does, without loading the agent: a runtime
//! starts it once per container and waits for it. `nftkube-portmap restore` puts the mappings back after a
//! firewall reload.
#![forbid(unsafe_code)]

use std::process::ExitCode;

fn main() -> ExitCode {
    // A runtime runs a CNI plugin without arguments; `restore` is the operator's (or a systemd unit's) command
    // after a firewall reload.
    if std::env::args_os().nth(1).is_some_and(|a| a == "restore") {
        return ExitCode::from(nftkube_portmap::restore_main());
    }
    // Whatever its name: a runtime may install it as `portmap`, an operator may run it as it is.
    ExitCode::from(nftkube_portmap::main())
}
