//! A real OCI registry for tests: Debian's `docker-registry` (the CNCF distribution
//! registry), on loopback with a temporary storage directory and a free port, killed on drop.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

pub struct OciRegistry {
    child: Child,
    dir: tempfile::TempDir,
    addr: String,
}

impl OciRegistry {
    /// A plain-HTTP registry anyone may use.
    pub fn start() -> OciRegistry {
        OciRegistry::start_with(|_| String::new())
    }

    /// A registry serving TLS (a self-signed certificate for 127.0.0.1, written to
    /// `ca.pem` in its directory, see [`OciRegistry::ca_file`]) that lets only `user` in,
    /// with the password whose bcrypt hash is `bcrypt`.
    pub fn start_tls_with_user(user: &str, bcrypt: &str) -> OciRegistry {
        OciRegistry::start_with(|dir| {
            let rcgen::CertifiedKey { cert, signing_key } =
                rcgen::generate_simple_self_signed(vec!["127.0.0.1".to_string()]).unwrap();
            let (cert_file, key_file, htpasswd) = (dir.join("ca.pem"), dir.join("key.pem"), dir.join("htpasswd"));
            std::fs::write(&cert_file, cert.pem()).unwrap();
            std::fs::write(&key_file, signing_key.serialize_pem()).unwrap();
            std::fs::write(&htpasswd, format!("{user}:{bcrypt}\n")).unwrap();
            format!(
                "  tls: {{ certificate: {}, key: {} }}\nauth: {{ htpasswd: {{ realm: wasmplane-test, path: {} }} }}\n",
                cert_file.display(),
                key_file.display(),
                htpasswd.display()
            )
        })
    }

    /// `extra_config(dir)`: YAML appended to the config, whose last line is the `http:` map's.
    fn start_with(extra_config: impl Fn(&Path) -> String) -> OciRegistry {
        // The port is free when picked, not held: another test's server or connection can take
        // it before the registry binds it, which then exits at once. Then another port is tried.
        let mut attempt = 1;
        loop {
            match OciRegistry::start_once(&extra_config) {
                Ok(registry) => return registry,
                Err(exited) if attempt < 5 && exited.contains("address already in use") => attempt += 1,
                Err(exited) => panic!("docker-registry exited {exited}"),
            }
        }
    }

    /// A started registry, or how it exited (its status and log) before it listened.
    fn start_once(extra_config: &impl Fn(&Path) -> String) -> Result<OciRegistry, String> {
        let binary = Path::new("/usr/bin/docker-registry");
        assert!(
            binary.is_file(),
            "{} is missing: run scripts/setup.sh (Debian package docker-registry)",
            binary.display()
        );
        let dir = tempfile::tempdir().unwrap();
        let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let addr = format!("127.0.0.1:{port}");
        let config = dir.path().join("config.yml");
        std::fs::write(
            &config,
            format!(
                "version: 0.1\nlog: {{ level: warn }}\nstorage: {{ filesystem: {{ rootdirectory: {} }}, delete: {{ enabled: true }} }}\nhttp:\n  addr: \"{addr}\"\n  secret: wasmplane-test\n{}",
                dir.path().join("data").display(),
                extra_config(dir.path())
            ),
        )
        .unwrap();
        let log = std::fs::File::create(dir.path().join("log")).unwrap();
        let child = Command::new(binary)
            .arg("serve")
            .arg(&config)
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .stdin(Stdio::null())
            .spawn()
            .expect("starting docker-registry");
        let mut registry = OciRegistry { child, dir, addr };
        let deadline = Instant::now() + Duration::from_secs(10);
        while std::net::TcpStream::connect(&registry.addr).is_err() {
            if let Ok(Some(status)) = registry.child.try_wait() {
                return Err(format!("({status}): {}", registry.log()));
            }
            assert!(
                Instant::now() < deadline,
                "docker-registry did not listen on {}: {}",
                registry.addr,
                registry.log()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(registry)
    }

    /// `HOST:PORT`.
    pub fn addr(&self) -> &str {
        &self.addr
    }

    /// The certificate a TLS registry serves (its own CA).
    pub fn ca_file(&self) -> PathBuf {
        self.dir.path().join("ca.pem")
    }

    /// Where the registry keeps blob `sha256:…`.
    pub fn blob_path(&self, digest: &str) -> PathBuf {
        let hex = digest.strip_prefix("sha256:").expect("a sha256 digest");
        self.dir.path().join(format!("data/docker/registry/v2/blobs/sha256/{}/{hex}/data", &hex[..2]))
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("log")).unwrap_or_default()
    }
}

impl Drop for OciRegistry {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
