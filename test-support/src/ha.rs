//! Throwaway Patroni clusters for the tests, and the faults they inject into them: the parts of
//! [`edge_runtime::ha`] only tests use. A throwaway cluster lives in a fresh temporary folder
//! on free ports (or on the ports and hosts the partition tests give it) and is removed when
//! dropped, or by its watchdog once the test process has exited.

pub use edge_runtime::ha::*;
use edge_runtime::postgres::{unique_temp_dir, unprivileged_ids};

use crate::net::free_port;
use crate::process::{send_signal, Signal};

/// Free loopback ports for every part (tests).
pub fn free_ports() -> HaPorts {
    HaPorts {
        etcd_client: free_port(),
        etcd_peer: free_port(),
        rest: [free_port(), free_port()],
        postgres: [free_port(), free_port()],
        proxy: free_port(),
    }
}

/// What the tests do to an [`HaCluster`] besides what `edge run` does.
pub trait HaClusterTestExt: Sized {
    /// A throwaway cluster on free ports.
    fn start() -> Result<Self, String>;

    /// A throwaway cluster whose parts run on `hosts`, on `ports` (the partition tests).
    fn start_on(hosts: HaHosts, ports: HaPorts) -> Result<Self, String>;

    /// The node is lost: its Patroni and its postmaster SIGKILLed together. The other node
    /// takes the leader key once its `ttl` has run out.
    fn lose_node(&mut self, i: usize);

    /// SIGKILL to node `i`'s postmaster alone: its Patroni restarts it in place (crash
    /// recovery), keeping the leader key.
    fn kill_postmaster(&self, i: usize) -> Result<u32, String>;
}

impl HaClusterTestExt for HaCluster {
    fn start() -> Result<Self, String> {
        Self::start_on(HaHosts::loopback(), free_ports())
    }

    fn start_on(hosts: HaHosts, ports: HaPorts) -> Result<Self, String> {
        let root =
            edge_runtime::data_home::throwaway_home(unique_temp_dir()?, unprivileged_ids()?)?;
        Self::launch(root, ports, hosts, true)
    }

    fn lose_node(&mut self, i: usize) {
        let postmaster = self.postmaster_pid(i);
        if let Some(p) = self.patroni_mut(i) {
            p.kill();
        }
        if let Some(pid) = postmaster {
            let _ = send_signal(pid, Signal::KILL);
        }
    }

    fn kill_postmaster(&self, i: usize) -> Result<u32, String> {
        let node = format!("node{}", i + 1);
        let pid = self
            .postmaster_pid(i)
            .ok_or_else(|| format!("{node} has no postmaster"))?;
        send_signal(pid, Signal::KILL).map_err(|e| format!("{node}: {e}"))?;
        Ok(pid)
    }
}
