//! Test harness running Debian's real etcd 3.4 (`etcd-server` package) on loopback.
//!
//! Why a real server: the kvstore's hard parts (watch resume after a disconnect,
//! compaction cancelling a watch, lease expiry) are behaviours of etcd itself, and a
//! fake would only encode our own assumptions about them.
//!
//! Every [`Etcd`] gets a private temporary directory and its own free client and
//! peer ports; it is started with `--unsafe-no-fsync --heartbeat-interval 10
//! --election-timeout 100`, which brings start-up to well under a second. The
//! process is killed when the value is dropped, so a failing test leaves nothing
//! behind. [`Etcd::restart`] keeps the data directory and the ports, which is what
//! watch-resume tests need: clients reconnect to the same address and find the same
//! revisions.
//!
//! [`Etcd::start_tls`] serves clients over TLS and asks them for a certificate
//! (`--client-cert-auth`), with a CA and certificates made for the test ([`TestPki`]).
//!
//! [`TcpProxy`] sits between a client and etcd and can cut every connection on
//! demand without touching the server, so a test can make one client miss a window
//! of history (and have it compacted) while another keeps writing.

use std::fs::File;
use std::io::{self, Read, Seek, SeekFrom};
use std::net::{SocketAddr, TcpListener as StdTcpListener};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::JoinHandle;

/// How long [`Etcd::start`] and [`Etcd::restart`] wait for a healthy server.
const START_TIMEOUT: Duration = Duration::from_secs(20);
/// How long a graceful [`Etcd::stop`] waits before falling back to SIGKILL.
const STOP_TIMEOUT: Duration = Duration::from_secs(5);

/// Why the harness could not provide a running etcd.
#[derive(thiserror::Error)]
pub enum HarnessError {
    /// The server binary is absent. Tests fail (rather than skip) on purpose, so a
    /// CI machine without etcd cannot go green by accident.
    #[error(
        "etcd binary not found (looked at $ETCD_BIN, $PATH and /usr/bin/etcd): install it with `apt-get install etcd-server`"
    )]
    BinaryMissing,
    #[error("I/O error while running etcd: {0}")]
    Io(#[from] io::Error),
    #[error("etcd exited during start-up ({status}); log tail:\n{log}")]
    Exited { status: ExitStatus, log: String },
    #[error("etcd did not become healthy within {timeout:?}; last error: {last_error}; log tail:\n{log}")]
    NotHealthy { timeout: Duration, last_error: String, log: String },
    #[error("etcd is not running")]
    NotRunning,
    #[error("etcd client error: {0}")]
    Client(#[from] etcd_client::Error),
    #[error("making test certificates: {0}")]
    Certificates(#[from] rcgen::Error),
}

/// Tests report errors with `expect`, which prints `Debug`: make that the
/// readable message (with the `apt-get` hint), not the variant name.
impl std::fmt::Debug for HarnessError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::Display::fmt(self, f)
    }
}

/// A real etcd server owned by a test. Killed on drop.
pub struct Etcd {
    binary: PathBuf,
    /// Holds `data/` and `etcd.log`; removed on drop, after the process is dead.
    dir: tempfile::TempDir,
    name: String,
    client_port: u16,
    peer_port: u16,
    /// Clients speak TLS and must present a certificate of this CA.
    tls: Option<TestPki>,
    /// The root user, once [`Etcd::enable_auth`] turned etcd's authentication on.
    root: Option<(String, String)>,
    child: Option<Child>,
}

impl Etcd {
    /// Starts a fresh single-member cluster and waits until it serves requests.
    pub async fn start() -> Result<Self, HarnessError> {
        Self::start_with(false).await
    }

    /// Like [`Etcd::start`], but clients must speak TLS and present a certificate
    /// issued by [`Etcd::pki`]'s CA (`--client-cert-auth`), as a production etcd does.
    pub async fn start_tls() -> Result<Self, HarnessError> {
        Self::start_with(true).await
    }

    async fn start_with(tls: bool) -> Result<Self, HarnessError> {
        // The ports are free when picked, not held: another test's etcd, server or outgoing
        // connection can take one before etcd binds it. etcd then exits at once; pick again.
        let mut attempt = 1;
        loop {
            match Self::start_once(tls).await {
                Err(HarnessError::Exited { log, .. }) if attempt < 5 && log.contains("address already in use") => {
                    tracing::warn!(attempt, "a port picked for etcd was taken before etcd bound it; picking others");
                    attempt += 1;
                }
                other => return other,
            }
        }
    }

    async fn start_once(tls: bool) -> Result<Self, HarnessError> {
        let binary = find_binary().ok_or(HarnessError::BinaryMissing)?;
        let dir = tempfile::Builder::new().prefix("wasmplane-etcd-").tempdir()?;
        let client_port = free_port()?;
        let mut peer_port = free_port()?;
        while peer_port == client_port {
            peer_port = free_port()?;
        }
        let tls = match tls {
            true => Some(TestPki::generate(&dir.path().join("pki"), "etcd")?),
            false => None,
        };
        let mut etcd = Etcd {
            binary,
            dir,
            name: format!("wasmplane-test-{client_port}"),
            client_port,
            peer_port,
            tls,
            root: None,
            child: None,
        };
        etcd.spawn_and_wait().await?;
        Ok(etcd)
    }

    /// The client URL, e.g. `http://127.0.0.1:40123` (`https://` with TLS).
    pub fn endpoint(&self) -> String {
        let scheme = if self.tls.is_some() { "https" } else { "http" };
        format!("{scheme}://127.0.0.1:{}", self.client_port)
    }

    /// The CA and certificates of a server started with [`Etcd::start_tls`].
    pub fn pki(&self) -> Option<&TestPki> {
        self.tls.as_ref()
    }

    /// The client address (for a [`TcpProxy`] in front of it).
    pub fn client_addr(&self) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], self.client_port))
    }

    /// The data directory, kept across [`Etcd::restart`].
    pub fn data_dir(&self) -> PathBuf {
        self.dir.path().join("data")
    }

    /// Whether the process is alive (it may have been stopped or killed by the test).
    pub fn is_running(&mut self) -> bool {
        match self.child.as_mut() {
            Some(child) => matches!(child.try_wait(), Ok(None)),
            None => false,
        }
    }

    /// The operating-system process id, while running.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// A fresh etcd-client connected to this server, for test set-up and assertions.
    pub async fn client(&self) -> Result<etcd_client::Client, HarnessError> {
        let mut options = etcd_client::ConnectOptions::new();
        if let Some(pki) = &self.tls {
            options = options.with_tls(pki.client_tls()?);
        }
        if let Some((user, password)) = &self.root {
            options = options.with_user(user, password);
        }
        Ok(etcd_client::Client::connect([self.endpoint()], Some(options)).await?)
    }

    /// Turns etcd's authentication on (`etcdctl auth enable`) with user `root` (every
    /// permission) and `user` (read and write under `prefix` only); from then on every
    /// client needs a user and password, the harness's own as `root`.
    pub async fn enable_auth(
        &mut self,
        root_password: &str,
        user: &str,
        password: &str,
        prefix: &str,
    ) -> Result<(), HarnessError> {
        let mut client = self.client().await?;
        client.user_add("root", root_password, None).await?;
        client.user_grant_role("root", "root").await?;
        client.role_add(user).await?;
        let end = {
            // The first key after every key starting with `prefix`.
            let mut end = prefix.as_bytes().to_vec();
            *end.last_mut().expect("a non-empty prefix") += 1;
            end
        };
        client.role_grant_permission(user, etcd_client::Permission::read_write(prefix).with_range_end(end)).await?;
        client.user_add(user, password, None).await?;
        client.user_grant_role(user, user).await?;
        client.auth_enable().await?;
        self.root = Some(("root".into(), root_password.into()));
        Ok(())
    }

    /// Graceful stop: SIGTERM, then SIGKILL if the process does not exit in time.
    pub async fn stop(&mut self) -> Result<(), HarnessError> {
        let Some(mut child) = self.child.take() else {
            return Ok(());
        };
        if let Some(pid) = rustix::process::Pid::from_raw(child.id() as i32) {
            // ESRCH (already gone) is fine: we reap it below either way.
            let _ = rustix::process::kill_process(pid, rustix::process::Signal::TERM);
        }
        let deadline = Instant::now() + STOP_TIMEOUT;
        loop {
            if child.try_wait()?.is_some() {
                tracing::debug!(port = self.client_port, "etcd stopped");
                return Ok(());
            }
            if Instant::now() >= deadline {
                tracing::warn!(port = self.client_port, "etcd ignored SIGTERM; killing");
                child.kill()?;
                child.wait()?;
                return Ok(());
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Abrupt stop (SIGKILL), like a crashed machine without the disk loss.
    pub async fn kill(&mut self) -> Result<(), HarnessError> {
        if let Some(mut child) = self.child.take() {
            child.kill()?;
            // SIGKILL makes the exit immediate; reaping it synchronously is fine.
            child.wait()?;
            tracing::debug!(port = self.client_port, "etcd killed");
        }
        Ok(())
    }

    /// Starts the server again with the same data directory and ports (stopping it
    /// gracefully first if it is still running) and waits until it is healthy.
    pub async fn restart(&mut self) -> Result<(), HarnessError> {
        self.stop().await?;
        self.spawn_and_wait().await
    }

    /// Compacts the key-value history up to `revision` (physically, so the
    /// compaction is complete when this returns). Watches behind it get cancelled.
    pub async fn compact(&self, revision: i64) -> Result<(), HarnessError> {
        let mut client = self.client().await?;
        client.compact(revision, Some(etcd_client::CompactionOptions::new().with_physical())).await?;
        Ok(())
    }

    /// The store's current revision.
    pub async fn current_revision(&self) -> Result<i64, HarnessError> {
        let mut client = self.client().await?;
        let resp = client.get("\0", Some(etcd_client::GetOptions::new().with_count_only())).await?;
        Ok(resp.header().map(|h| h.revision()).unwrap_or(0))
    }

    /// Compacts everything up to the current revision and returns that revision.
    pub async fn compact_to_current(&self) -> Result<i64, HarnessError> {
        let revision = self.current_revision().await?;
        self.compact(revision).await?;
        Ok(revision)
    }

    fn log_path(&self) -> PathBuf {
        self.dir.path().join("etcd.log")
    }

    async fn spawn_and_wait(&mut self) -> Result<(), HarnessError> {
        let log = File::options().create(true).append(true).open(self.log_path())?;
        let client_url = self.endpoint();
        let peer_url = format!("http://127.0.0.1:{}", self.peer_port);
        let mut command = Command::new(&self.binary);
        if let Some(pki) = &self.tls {
            command
                .arg("--cert-file")
                .arg(&pki.server_cert)
                .arg("--key-file")
                .arg(&pki.server_key)
                .arg("--client-cert-auth")
                .arg("--trusted-ca-file")
                .arg(&pki.ca);
        }
        let child = command
            .arg("--name")
            .arg(&self.name)
            .arg("--data-dir")
            .arg(self.data_dir())
            .arg("--listen-client-urls")
            .arg(&client_url)
            .arg("--advertise-client-urls")
            .arg(&client_url)
            .arg("--listen-peer-urls")
            .arg(&peer_url)
            .arg("--initial-advertise-peer-urls")
            .arg(&peer_url)
            .arg("--initial-cluster")
            .arg(format!("{}={peer_url}", self.name))
            .arg("--initial-cluster-state")
            .arg("new")
            .arg("--unsafe-no-fsync")
            .arg("--heartbeat-interval")
            .arg("10")
            .arg("--election-timeout")
            .arg("100")
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()?;
        tracing::debug!(pid = child.id(), endpoint = %client_url, "etcd spawned");
        self.child = Some(child);
        self.wait_healthy().await
    }

    async fn wait_healthy(&mut self) -> Result<(), HarnessError> {
        let started = Instant::now();
        let mut last_error: String;
        // Connecting is lazy in etcd-client; requests are what tell us it is up.
        let mut client = self.client().await?;
        loop {
            let exited = match self.child.as_mut() {
                Some(child) => child.try_wait()?,
                None => return Err(HarnessError::NotRunning),
            };
            if let Some(status) = exited {
                self.child = None;
                return Err(HarnessError::Exited { status, log: tail(&self.log_path()) });
            }
            // A linearizable read needs an elected leader, so success means the
            // member is really ready, not only listening.
            match tokio::time::timeout(Duration::from_millis(500), client.get("health", None)).await {
                Ok(Ok(_)) => {
                    tracing::debug!(
                        endpoint = %self.endpoint(),
                        elapsed = ?started.elapsed(),
                        "etcd healthy"
                    );
                    return Ok(());
                }
                Ok(Err(e)) => last_error = e.to_string(),
                Err(_) => last_error = "request timed out".into(),
            }
            if started.elapsed() > START_TIMEOUT {
                return Err(HarnessError::NotHealthy {
                    timeout: START_TIMEOUT,
                    last_error,
                    log: tail(&self.log_path()),
                });
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

impl Drop for Etcd {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            // Kill before the temp dir is removed, and reap so no zombie remains.
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

impl std::fmt::Debug for Etcd {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Etcd")
            .field("endpoint", &self.endpoint())
            .field("pid", &self.pid())
            .field("dir", &self.dir.path())
            .finish()
    }
}

fn find_binary() -> Option<PathBuf> {
    if let Some(path) = std::env::var_os("ETCD_BIN") {
        let path = PathBuf::from(path);
        return path.is_file().then_some(path);
    }
    let from_path = std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths).map(|dir| dir.join("etcd")).find(|candidate| candidate.is_file())
    });
    from_path.or_else(|| {
        let fallback = PathBuf::from("/usr/bin/etcd");
        fallback.is_file().then_some(fallback)
    })
}

/// A port the kernel just handed out. Another process could grab it before etcd
/// binds it, but on a test machine that race is rare and fails loudly (etcd exits).
fn free_port() -> io::Result<u16> {
    let listener = StdTcpListener::bind(("127.0.0.1", 0))?;
    Ok(listener.local_addr()?.port())
}

/// The last few KiB of the etcd log, for error messages.
fn tail(path: &Path) -> String {
    const TAIL: u64 = 4096;
    let read = || -> io::Result<String> {
        let mut file = File::open(path)?;
        let len = file.metadata()?.len();
        file.seek(SeekFrom::Start(len.saturating_sub(TAIL)))?;
        let mut buf = Vec::new();
        file.read_to_end(&mut buf)?;
        Ok(String::from_utf8_lossy(&buf).into_owned())
    };
    read().unwrap_or_else(|e| format!("(cannot read {}: {e})", path.display()))
}

/// A CA and the certificates it issued for a test, as PEM files: a server certificate
/// for `127.0.0.1` and `localhost`, and a client certificate.
#[derive(Debug, Clone)]
pub struct TestPki {
    pub ca: PathBuf,
    pub server_cert: PathBuf,
    pub server_key: PathBuf,
    pub client_cert: PathBuf,
    pub client_key: PathBuf,
}

impl TestPki {
    /// Makes a new CA (so two calls make CAs that do not trust each other's
    /// certificates) and writes `<name>-ca.pem`, `<name>-server{,-key}.pem` and
    /// `<name>-client{,-key}.pem` into `dir`.
    pub fn generate(dir: &Path, name: &str) -> Result<TestPki, HarnessError> {
        use rcgen::{
            BasicConstraints, CertificateParams, CertifiedIssuer, DnType, ExtendedKeyUsagePurpose, IsCa, KeyPair,
        };
        std::fs::create_dir_all(dir)?;
        let mut ca_params = CertificateParams::new(Vec::new())?;
        ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        ca_params.distinguished_name.push(DnType::CommonName, format!("{name} test CA"));
        let ca = CertifiedIssuer::self_signed(ca_params, KeyPair::generate()?)?;
        let issue = |sans: Vec<String>, common_name: &str, usage: ExtendedKeyUsagePurpose| {
            let mut params = CertificateParams::new(sans)?;
            params.distinguished_name.push(DnType::CommonName, common_name);
            params.extended_key_usages = vec![usage];
            let key = KeyPair::generate()?;
            let cert = params.signed_by(&key, &ca)?;
            Ok::<_, rcgen::Error>((cert.pem(), key.serialize_pem()))
        };
        let (server_cert, server_key) =
            issue(vec!["127.0.0.1".into(), "localhost".into()], "etcd server", ExtendedKeyUsagePurpose::ServerAuth)?;
        let (client_cert, client_key) = issue(Vec::new(), "wasmplane", ExtendedKeyUsagePurpose::ClientAuth)?;
        let write = |file: &str, pem: &str| -> io::Result<PathBuf> {
            let path = dir.join(format!("{name}-{file}.pem"));
            std::fs::write(&path, pem)?;
            Ok(path)
        };
        Ok(TestPki {
            ca: write("ca", &ca.pem())?,
            server_cert: write("server", &server_cert)?,
            server_key: write("server-key", &server_key)?,
            client_cert: write("client", &client_cert)?,
            client_key: write("client-key", &client_key)?,
        })
    }

    /// etcd-client's TLS options presenting the client certificate and trusting the CA.
    pub fn client_tls(&self) -> io::Result<etcd_client::TlsOptions> {
        Ok(etcd_client::TlsOptions::new()
            .ca_certificate(etcd_client::Certificate::from_pem(std::fs::read(&self.ca)?))
            .identity(etcd_client::Identity::from_pem(
                std::fs::read(&self.client_cert)?,
                std::fs::read(&self.client_key)?,
            )))
    }
}

/// A loopback TCP forwarder whose connections can be cut on demand.
///
/// Point a client at [`TcpProxy::endpoint`]; [`TcpProxy::cut`] closes every
/// forwarded connection and refuses new ones until [`TcpProxy::restore`]. The
/// server behind it keeps running, so other clients can change (and compact) the
/// store while this one is cut off.
pub struct TcpProxy {
    addr: SocketAddr,
    enabled: Arc<AtomicBool>,
    /// Bumped on every cut; connection tasks end when it changes.
    generation: watch::Sender<u64>,
    /// Forwarded connections still open.
    active: Arc<AtomicUsize>,
    accept_task: JoinHandle<()>,
}

impl TcpProxy {
    /// Listens on a free loopback port and forwards to `target`.
    pub async fn start(target: SocketAddr) -> io::Result<Self> {
        let listener = TcpListener::bind(("127.0.0.1", 0)).await?;
        let addr = listener.local_addr()?;
        let enabled = Arc::new(AtomicBool::new(true));
        let (generation, _) = watch::channel(0u64);
        let active = Arc::new(AtomicUsize::new(0));
        let accept_task =
            tokio::spawn(accept_loop(listener, target, enabled.clone(), generation.clone(), active.clone()));
        Ok(TcpProxy { addr, enabled, generation, active, accept_task })
    }

    /// The proxy's URL, e.g. `http://127.0.0.1:40124`.
    pub fn endpoint(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Closes all forwarded connections and refuses new ones. Returns once every
    /// connection is closed, so nothing sent by the server afterwards can still
    /// reach the client.
    pub async fn cut(&self) {
        self.cut_now();
        let deadline = Instant::now() + Duration::from_secs(5);
        while self.active.load(Ordering::SeqCst) > 0 && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        tracing::debug!(proxy = %self.addr, "proxy cut");
    }

    fn cut_now(&self) {
        self.enabled.store(false, Ordering::SeqCst);
        self.generation.send_modify(|g| *g += 1);
    }

    /// Accepts and forwards connections again.
    pub fn restore(&self) {
        self.enabled.store(true, Ordering::SeqCst);
        tracing::debug!(proxy = %self.addr, "proxy restored");
    }
}

impl Drop for TcpProxy {
    fn drop(&mut self) {
        self.accept_task.abort();
        // Ends the connection tasks too: their generation receiver sees a change.
        self.cut_now();
    }
}

async fn accept_loop(
    listener: TcpListener,
    target: SocketAddr,
    enabled: Arc<AtomicBool>,
    generation: watch::Sender<u64>,
    active: Arc<AtomicUsize>,
) {
    /// Counts a connection as open for as long as its task runs.
    struct Open(Arc<AtomicUsize>);
    impl Drop for Open {
        fn drop(&mut self) {
            self.0.fetch_sub(1, Ordering::SeqCst);
        }
    }
    loop {
        let (mut inbound, _) = match listener.accept().await {
            Ok(conn) => conn,
            Err(e) => {
                tracing::warn!(error = %e, "proxy accept failed");
                tokio::time::sleep(Duration::from_millis(10)).await;
                continue;
            }
        };
        if !enabled.load(Ordering::SeqCst) {
            drop(inbound);
            continue;
        }
        let mut cut = generation.subscribe();
        cut.mark_unchanged();
        active.fetch_add(1, Ordering::SeqCst);
        let open = Open(active.clone());
        tokio::spawn(async move {
            let _open = open;
            let mut outbound = match TcpStream::connect(target).await {
                Ok(s) => s,
                Err(e) => {
                    tracing::debug!(error = %e, "proxy upstream connect failed");
                    return;
                }
            };
            tokio::select! {
                _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound) => {}
                _ = cut.changed() => {}
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn starts_restarts_and_compacts() {
        let mut etcd = Etcd::start().await.expect("etcd starts");
        let mut client = etcd.client().await.expect("client");
        client.put("k", "v1", None).await.expect("put");
        let rev = etcd.current_revision().await.expect("revision");
        assert!(rev >= 2);

        etcd.kill().await.expect("kill");
        assert!(!etcd.is_running());
        etcd.restart().await.expect("restart");
        assert!(etcd.is_running());
        let mut client = etcd.client().await.expect("client");
        let resp = client.get("k", None).await.expect("get after restart");
        assert_eq!(resp.kvs()[0].value(), b"v1", "data dir kept across restart");

        client.put("k", "v2", None).await.expect("put");
        let compacted = etcd.compact_to_current().await.expect("compact");
        let old = client.get("k", Some(etcd_client::GetOptions::new().with_revision(rev))).await;
        assert!(old.is_err(), "revision {rev} is compacted (at {compacted})");

        let pid = etcd.pid().expect("pid");
        drop(etcd);
        assert!(!Path::new(&format!("/proc/{pid}")).exists(), "etcd process {pid} is gone after drop");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn proxy_cuts_and_restores() {
        let etcd = Etcd::start().await.expect("etcd starts");
        let proxy = TcpProxy::start(etcd.client_addr()).await.expect("proxy");
        let opts = etcd_client::ConnectOptions::new().with_connect_timeout(Duration::from_millis(300));
        let mut client = etcd_client::Client::connect([proxy.endpoint()], Some(opts)).await.expect("client");
        client.put("k", "v", None).await.expect("put through proxy");
        proxy.cut().await;
        let cut = tokio::time::timeout(Duration::from_secs(2), client.get("k", None)).await;
        assert!(!matches!(cut, Ok(Ok(_))), "request through a cut proxy fails");
        proxy.restore();
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            match tokio::time::timeout(Duration::from_secs(1), client.get("k", None)).await {
                Ok(Ok(resp)) => {
                    assert_eq!(resp.kvs()[0].value(), b"v");
                    break;
                }
                _ if Instant::now() < deadline => tokio::time::sleep(Duration::from_millis(50)).await,
                other => panic!("client did not reconnect after restore: {other:?}"),
            }
        }
    }
}
