//! `nftkube-portmap`: the CNI portmap plugin alone, the binary a runtime finds in its CNI_PATH (under the name
//! `portmap` or `nftkube-portmap`). It does what `nftkube portmap` does, without loading the agent: a runtime
//! starts it once per container and waits for it.
#![forbid(unsafe_code)]

use std::process::ExitCode;

fn main() -> ExitCode {
    // Whatever its name: a runtime may install it as `portmap`, an operator may run it as it is.
    ExitCode::from(nftkube_portmap::main())
}
