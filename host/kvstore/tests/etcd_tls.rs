//! etcd over TLS with client certificates (`--client-cert-auth`), as production etcds and
//! Cilium's clustermesh run it: Debian's etcd 3.4 with a CA and certificates made for the
//! test. The store works with the right CA and certificate, and every wrong setting is
//! refused, either at configuration with a message naming it or by the handshake.

mod support;

use std::time::Duration;

use futures::StreamExt;
use wasmplane_kvstore::{Bytes, EtcdStore, EtcdTlsFiles, EtcdUser, KvError, KvStore};
use wasmplane_test_etcd::{Etcd, TestPki};

use support::{etcd_config, init_tracing};

fn files(ca: &TestPki, client: Option<&TestPki>) -> EtcdTlsFiles {
    EtcdTlsFiles {
        trusted_ca_file: ca.ca.clone(),
        cert_file: client.map(|pki| pki.client_cert.clone()),
        key_file: client.map(|pki| pki.client_key.clone()),
    }
}

async fn store(endpoint: String, tls: &EtcdTlsFiles) -> Result<EtcdStore, KvError> {
    EtcdStore::connect(etcd_config(endpoint).with_tls(Some(tls.load().expect("test PEM files")))).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_certificate_of_the_trusted_ca_reads_writes_and_watches() {
    init_tracing();
    let etcd = Etcd::start_tls().await.expect("etcd must start (apt-get install etcd-server)");
    let pki = etcd.pki().unwrap();
    assert!(etcd.endpoint().starts_with("https://"));
    let store = store(etcd.endpoint(), &files(pki, Some(pki))).await.unwrap();

    let mut watch = store.watch_prefix("tls/", None).await.unwrap();
    store.put("tls/a", Bytes::from_static(b"1"), None).await.unwrap();
    assert_eq!(store.get("tls/a").await.unwrap().unwrap().value, Bytes::from_static(b"1"));
    let event =
        tokio::time::timeout(Duration::from_secs(10), watch.next()).await.expect("an event in time").unwrap().unwrap();
    assert_eq!((event.key.as_str(), event.value.as_deref()), ("tls/a", Some(&b"1"[..])));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wrong_or_missing_tls_settings_are_refused() {
    init_tracing();
    let etcd = Etcd::start_tls().await.expect("etcd must start (apt-get install etcd-server)");
    let pki = etcd.pki().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let stranger = TestPki::generate(dir.path(), "stranger").unwrap();

    // Refused before any connection, naming what is missing.
    let plain = EtcdStore::connect(etcd_config(etcd.endpoint())).await.err().expect("https without a CA is refused");
    assert!(matches!(&plain, KvError::InvalidArgument(m) if m.contains("no trusted CA")), "{plain}");
    let http = etcd.endpoint().replacen("https://", "http://", 1);
    let mixed = store(http, &files(pki, Some(pki))).await.err().expect("TLS with http:// is refused");
    assert!(matches!(&mixed, KvError::InvalidArgument(m) if m.contains("not https://")), "{mixed}");

    // Refused by the handshake: requests fail, and say why.
    for (what, tls) in [
        ("no client certificate (etcd has --client-cert-auth)", files(pki, None)),
        ("a client certificate of another CA", files(pki, Some(&stranger))),
        ("another CA trusted for the server", files(&stranger, Some(pki))),
    ] {
        let store = store(etcd.endpoint(), &tls).await.unwrap();
        let error = store.get("tls/a").await.err().unwrap_or_else(|| panic!("{what}: the request succeeded"));
        assert!(matches!(error, KvError::Unavailable(_)), "{what}: {error}");
        if what.starts_with("another CA trusted") {
            assert!(error.to_string().contains("certificate"), "{what}: the reason is lost: {error}");
        }
    }
}

/// A rotated client certificate (cert-manager renewing a Secret) is used without a restart:
/// here rotated to one etcd does not trust, so requests fail once it is read, and back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rotated_certificate_files_are_read_again() {
    init_tracing();
    let etcd = Etcd::start_tls().await.expect("etcd must start (apt-get install etcd-server)");
    let pki = etcd.pki().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let stranger = TestPki::generate(&dir.path().join("stranger"), "stranger").unwrap();
    let (cert, key) = (dir.path().join("client.pem"), dir.path().join("client-key.pem"));
    let install = |from: &TestPki| {
        std::fs::copy(&from.client_cert, &cert).unwrap();
        std::fs::copy(&from.client_key, &key).unwrap();
    };
    install(pki);
    let files =
        EtcdTlsFiles { trusted_ca_file: pki.ca.clone(), cert_file: Some(cert.clone()), key_file: Some(key.clone()) };
    let mut config = etcd_config(etcd.endpoint()).with_tls(Some(files.load().unwrap()));
    config.tls_reload_interval = Duration::from_millis(100);
    let store = EtcdStore::connect(config).await.unwrap();
    store.put("rotation", Bytes::from_static(b"1"), None).await.unwrap();

    let answers = |expected: bool| {
        let store = store.clone();
        async move {
            let deadline = std::time::Instant::now() + Duration::from_secs(10);
            loop {
                if store.get("rotation").await.is_ok() == expected {
                    return;
                }
                assert!(
                    std::time::Instant::now() < deadline,
                    "the store never {} requests",
                    if expected { "answered" } else { "refused" }
                );
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    };
    install(&stranger);
    answers(false).await;
    install(pki);
    answers(true).await;
    // A half-written file (a key without its certificate yet) is not taken.
    std::fs::write(&cert, "").unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    answers(true).await;
}

/// etcd's own users (`--auth`): a user name and password, over TLS, held to the role etcd
/// gives it; a wrong password is refused at connect, naming why.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_users_authenticate_and_are_held_to_their_roles() {
    init_tracing();
    let mut etcd = Etcd::start_tls().await.expect("etcd must start (apt-get install etcd-server)");
    etcd.enable_auth("root-pw", "agent", "agent-pw", "/wasmplane/").await.unwrap();
    let pki = etcd.pki().unwrap();
    let connect = |password: Option<&str>| {
        let user = password.map(|password| EtcdUser { name: "agent".into(), password: password.into() });
        EtcdStore::connect(
            etcd_config(etcd.endpoint()).with_tls(Some(files(pki, Some(pki)).load().unwrap())).with_user(user),
        )
    };
    let store = connect(Some("agent-pw")).await.unwrap();
    store.put("/wasmplane/x", Bytes::from_static(b"1"), None).await.unwrap();
    assert_eq!(store.get("/wasmplane/x").await.unwrap().unwrap().value, Bytes::from_static(b"1"));
    let outside = store.put("/elsewhere", Bytes::from_static(b"1"), None).await.unwrap_err();
    assert!(outside.to_string().contains("permission denied"), "{outside}");

    let wrong = connect(Some("not-the-password")).await.err().expect("a wrong password is refused");
    assert!(wrong.to_string().contains("authentication failed"), "{wrong}");
    // No user: the client certificate's name is no etcd user.
    let anonymous = connect(None).await.unwrap();
    let refused = anonymous.get("/wasmplane/x").await.unwrap_err();
    assert!(
        refused.to_string().contains("permission denied") || refused.to_string().contains("user name"),
        "{refused}"
    );
}
