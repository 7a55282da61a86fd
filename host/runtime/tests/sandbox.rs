//! The sandbox, below the API: limits stop misbehaving guests with typed errors, the
//! runtime stays usable afterwards, and the disk cache is keyed by content.

use std::sync::Arc;
use std::time::{Duration, Instant};

use wasmplane_guest_artifacts as artifacts;
use wasmplane_model::state::{LocalEndpoint, LocalSlice, NodeContext, ServiceView};
use wasmplane_model::*;
use wasmplane_runtime::{CallError, GuestKind, Limits, LoadError, NoLookups, Runtime};

fn runtime(cache: Option<std::path::PathBuf>) -> Runtime {
    Runtime::new(
        Limits {
            call_timeout: Duration::from_millis(100),
            memory_bytes: 16 << 20,
            max_instances: 8,
            ..Default::default()
        },
        cache,
    )
    .unwrap()
}

fn view() -> ServiceView {
    ServiceView {
        service: Service::cluster_ip("shop", "web", "10.96.0.20", vec![ServicePort::tcp("http", 80, 8080)]).into(),
        slices: vec![LocalSlice {
            name: "web-1".into(),
            endpoints: vec![LocalEndpoint {
                addresses: vec!["10.244.0.11".into()],
                ready: true,
                serving: true,
                terminating: false,
                node_name: None,
                zone: None,
                is_local: false,
            }],
            ports: vec![EndpointPort { name: "http".into(), protocol: Protocol::Tcp, port: 8080 }],
        }],
    }
}

fn call(rt: &Runtime, bytes: &[u8]) -> Result<wasmplane_runtime::wit::Ruleset, CallError> {
    let module = rt.load("t", bytes, Some(GuestKind::ServiceTranslator), usize::MAX).unwrap();
    let mut session = module.translator(Arc::new(NoLookups)).unwrap();
    session.translate(&NodeContext::default(), "svc/shop/web", &view())
}

#[test]
fn limits_stop_guests_with_typed_errors() {
    let rt = runtime(None);
    let started = Instant::now();
    assert_eq!(
        call(&rt, artifacts::test_programs::LOOP_FOREVER).unwrap_err(),
        CallError::Timeout(Duration::from_millis(100))
    );
    // The error says the 100 ms deadline stopped it; the bound (which includes compiling the
    // guest) only catches a stop far later, with room for a loaded 2-core machine.
    assert!(started.elapsed() < Duration::from_secs(30), "{:?}", started.elapsed());
    assert_eq!(call(&rt, artifacts::test_programs::ALLOCATE_FOREVER).unwrap_err(), CallError::MemoryLimit(16 << 20));
    match call(&rt, artifacts::test_programs::TRAP).unwrap_err() {
        CallError::Trap(msg) => assert!(msg.contains("this guest always traps"), "{msg}"),
        other => panic!("expected a trap, got {other:?}"),
    }
    // The runtime is fine afterwards.
    let out = call(&rt, artifacts::SERVICE_TRANSLATOR).unwrap();
    assert!(out.map_elements.iter().any(|e| e.map_name == "service-backends"), "{out:?}");
}

/// The deadline clock runs only while guest code does: an idle host is not woken every 5 ms,
/// and a looping guest is still stopped on time.
#[test]
fn the_epoch_advances_only_while_a_guest_runs() {
    let rt = runtime(None);
    let loaded = rt.load("loop", artifacts::test_programs::LOOP_FOREVER, None, usize::MAX).unwrap();
    std::thread::sleep(Duration::from_millis(50));
    assert_eq!(rt.epoch_ticks(), 0, "no guest has run");
    let started = Instant::now();
    let error = loaded
        .translator(Arc::new(NoLookups))
        .unwrap()
        .translate(&NodeContext::default(), "svc/shop/web", &view())
        .unwrap_err();
    assert_eq!(error, CallError::Timeout(Duration::from_millis(100)));
    // Generous: the error already says the deadline stopped it; a loaded machine stretches time.
    assert!(started.elapsed() < Duration::from_secs(30), "{:?}", started.elapsed());
    let after_call = rt.epoch_ticks();
    assert!(after_call >= 20, "a 100 ms deadline is 20 ticks: {after_call}");
    std::thread::sleep(Duration::from_millis(60));
    // One tick may have been under way when the call ended.
    assert!(rt.epoch_ticks() <= after_call + 1, "the ticker kept going: {after_call} -> {}", rt.epoch_ticks());
}

#[test]
fn a_session_recovers_after_a_failed_call() {
    let rt = runtime(None);
    // The typed translator declines the service itself; the shipped (archived) one is never
    // called with it: the host refuses an address that does not parse as it archives it.
    for (bytes, declined) in [
        (
            artifacts::test_programs::TRANSLATOR_TYPED,
            (|e| matches!(e, CallError::Guest(m) if m.contains("invalid IP"))) as fn(&CallError) -> bool,
        ),
        (artifacts::SERVICE_TRANSLATOR, |e| matches!(e, CallError::Input(m) if m.contains("invalid IP"))),
    ] {
        let module = rt.load("t", bytes, None, usize::MAX).unwrap();
        assert_eq!(module.info.kind, GuestKind::ServiceTranslator);
        assert!(
            module.info.imports.iter().all(|i| i.starts_with("wasi:") || i.starts_with("wasmplane:dataplane/")),
            "{:?}",
            module.info.imports
        );
        let mut session = module.translator(Arc::new(NoLookups)).unwrap();
        let mut bad = view();
        std::sync::Arc::make_mut(&mut bad.service).cluster_ips = vec!["10.96.0.300".into()];
        let refused = session.translate(&NodeContext::default(), "svc/shop/web", &bad).unwrap_err();
        assert!(declined(&refused), "{refused:?}");
        assert!(session.translate(&NodeContext::default(), "svc/shop/web", &view()).is_ok());
    }
}

#[test]
fn refuses_what_is_not_a_guest() {
    let rt = runtime(None);
    let load = |bytes: &[u8], kind| rt.load("t", bytes, kind, 1 << 20).err();
    assert_eq!(load(b"nope", None), Some(LoadError::NotWasm));
    assert_eq!(load(b"\0asm\x01\0\0\0", None), Some(LoadError::CoreModule));
    assert!(matches!(load(&vec![0u8; 2 << 20], None), Some(LoadError::TooLarge { .. })));
    assert!(matches!(load(artifacts::test_programs::WRONG_WORLD, None), Some(LoadError::UnknownWorld { .. })));
    assert_eq!(
        load(artifacts::SERVICE_TRANSLATOR, Some(GuestKind::Gc)),
        Some(LoadError::KindMismatch { declared: GuestKind::Gc, found: GuestKind::ServiceTranslator })
    );
    let mut truncated = artifacts::SERVICE_TRANSLATOR.to_vec();
    truncated.truncate(truncated.len() / 2);
    assert!(matches!(load(&truncated, None), Some(LoadError::Compile(_))));
}

#[test]
fn compiled_components_are_cached_by_content() {
    let dir = tempfile::tempdir().unwrap();
    let rt = runtime(Some(dir.path().to_path_buf()));
    rt.load("t", artifacts::SERVICE_TRANSLATOR, None, usize::MAX).unwrap();
    let files: Vec<_> =
        std::fs::read_dir(dir.path()).unwrap().map(|e| e.unwrap().file_name().into_string().unwrap()).collect();
    assert_eq!(files.len(), 1);
    let digest = wasmplane_runtime::LoadedModule::digest_of(artifacts::SERVICE_TRANSLATOR);
    assert!(files[0].starts_with(digest.trim_start_matches("sha256:")), "{files:?}");
    // A second runtime loads from the cache and still works.
    let again = runtime(Some(dir.path().to_path_buf()));
    assert!(call(&again, artifacts::SERVICE_TRANSLATOR).is_ok());
}

#[test]
fn output_over_the_cap_is_refused() {
    // One endpoint as data: its backend, cluster IP, off-cluster masquerade and hairpin
    // elements, 4 objects.
    let rt = Runtime::new(Limits { max_output_objects: 2, max_instances: 4, ..Default::default() }, None).unwrap();
    match call(&rt, artifacts::SERVICE_TRANSLATOR).unwrap_err() {
        CallError::OutputTooLarge(msg) => assert!(msg.contains("4 objects") && msg.contains("limits 2"), "{msg}"),
        other => panic!("expected OutputTooLarge, got {other:?}"),
    }
}

/// The host's engine has no compiler: guests compile on a throwaway engine or in a child
/// process, and Cranelift's state never stays in the host (see `loader.rs`). Loading still
/// works, through the compiled code.
#[test]
fn the_host_engine_loads_guests_but_cannot_compile() {
    let rt = runtime(None);
    let err = wasmtime::component::Component::new(rt.engine(), artifacts::SERVICE_TRANSLATOR)
        .expect_err("the host's engine compiled a component");
    assert!(format!("{err:#}").contains("not configured with a compiler"), "{err:#}");
    let rules = call(&rt, artifacts::SERVICE_TRANSLATOR).expect("a guest compiled elsewhere runs on it");
    assert!(!rules.map_elements.is_empty(), "{rules:?}");
}
