//! What the kernel benches share: root detection and a network namespace of their own.

use std::os::fd::AsRawFd as _;
use std::process::Command;

pub fn is_root() -> bool {
    Command::new("id").arg("-u").output().map(|o| String::from_utf8_lossy(&o.stdout).trim() == "0").unwrap_or(false)
}

/// A named network namespace, deleted on drop.
pub struct Netns(pub String);

impl Netns {
    pub fn new(name: String) -> Netns {
        let _ = Command::new("ip").args(["netns", "del", &name]).output();
        assert!(Command::new("ip").args(["netns", "add", &name]).status().unwrap().success(), "ip netns add {name}");
        Netns(name)
    }

    /// How the writer runs nft in this namespace.
    pub fn nft_command(&self) -> Vec<String> {
        ["ip", "netns", "exec", &self.0, "nft"].map(String::from).to_vec()
    }

    /// Runs a command in the namespace; panics when it fails.
    #[allow(dead_code)] // not every bench runs commands there
    pub fn exec(&self, args: &[&str]) {
        assert!(Command::new("ip").args(["netns", "exec", &self.0]).args(args).status().unwrap().success(), "{args:?}");
    }

    /// Runs `f` on a thread inside the namespace.
    #[allow(dead_code)]
    pub fn run<T: Send>(&self, f: impl FnOnce() -> T + Send) -> T {
        let file = std::fs::File::open(format!("/run/netns/{}", self.0)).unwrap();
        std::thread::scope(|s| {
            s.spawn(|| {
                // SAFETY: setns on this thread only, with a valid namespace descriptor.
                assert_eq!(unsafe { libc::setns(file.as_raw_fd(), libc::CLONE_NEWNET) }, 0, "setns");
                f()
            })
            .join()
            .unwrap()
        })
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        let _ = Command::new("ip").args(["netns", "del", &self.0]).output();
    }
}
