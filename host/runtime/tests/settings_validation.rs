//! A module's own settings check (the optional `settings-validation` export): what it says
//! of a document, modules without it, a validator that traps, one with another signature.

use std::time::Duration;

use wasmplane_guest_artifacts as artifacts;
use wasmplane_runtime::{CallError, GuestKind, Limits, LoadError, Runtime, SettingsVerdict};

fn runtime(limits: Limits) -> Runtime {
    Runtime::new(Limits { call_timeout: Duration::from_millis(200), max_instances: 8, ..limits }, None).unwrap()
}

#[test]
fn a_module_exporting_a_validator_says_which_settings_it_takes() {
    let rt = runtime(Limits::default());
    let module = rt
        .load(
            "port-filter",
            artifacts::examples::PORT_FILTER_TRANSLATOR,
            Some(GuestKind::ServiceTranslator),
            usize::MAX,
        )
        .unwrap();
    assert_eq!(module.validate_settings("{}"), Ok(SettingsVerdict::Valid));
    assert_eq!(module.validate_settings(r#"{"label": "team", "value": "edge"}"#), Ok(SettingsVerdict::Valid));
    match module.validate_settings(r#"{"lable": "team"}"#) {
        Ok(SettingsVerdict::Invalid(message)) => assert!(message.contains("unknown field `lable`"), "{message}"),
        other => panic!("expected a refusal naming the key, got {other:?}"),
    }
    match module.validate_settings(r#"{"label": "team"}"#) {
        Ok(SettingsVerdict::Invalid(message)) => {
            assert!(message.contains("`label` given without `value`"), "{message}")
        }
        other => panic!("expected a refusal naming the missing key, got {other:?}"),
    }
    // The settings it runs with do not matter: the document under test is what it checks.
    let configured = rt
        .load("port-filter", artifacts::examples::PORT_FILTER_TRANSLATOR, None, usize::MAX)
        .unwrap()
        .with_settings(r#"{"label": "team", "value": "edge"}"#);
    assert!(matches!(configured.validate_settings("5"), Ok(SettingsVerdict::Invalid(_))));
}

#[test]
fn modules_without_the_export_load_and_have_no_verdict() {
    let rt = runtime(Limits::default());
    let translator =
        rt.load("st", artifacts::SERVICE_TRANSLATOR, Some(GuestKind::ServiceTranslator), usize::MAX).unwrap();
    assert_eq!(translator.validate_settings("{\"anything\": 1}"), Ok(SettingsVerdict::NotImplemented));
    let policy = rt.load_policy("np", artifacts::NETWORK_POLICY, usize::MAX).unwrap();
    assert_eq!(policy.validate_settings("{}"), Ok(SettingsVerdict::NotImplemented));
}

#[test]
fn the_builtin_gc_guest_checks_its_grace_periods() {
    let rt = runtime(Limits::default());
    let gc = rt.load_gc("gc", artifacts::GC, usize::MAX).unwrap();
    assert_eq!(gc.validate_settings("{}"), Ok(SettingsVerdict::Valid));
    assert_eq!(gc.validate_settings(r#"{"graceSeconds": {"node-status": 900}}"#), Ok(SettingsVerdict::Valid));
    match gc.validate_settings(r#"{"graceSeconds": {"nodes": 900}}"#) {
        Ok(SettingsVerdict::Invalid(reason)) => assert!(reason.contains("unknown variant `nodes`"), "{reason}"),
        other => panic!("refused, not {other:?}"),
    }
}

#[test]
fn a_trapping_validator_is_an_error_not_a_verdict() {
    let rt = runtime(Limits::default());
    let module = rt
        .load("t", artifacts::test_programs::TRAPPING_VALIDATOR, Some(GuestKind::ServiceTranslator), usize::MAX)
        .unwrap();
    match module.validate_settings("{}") {
        Err(CallError::Trap(message)) => {
            assert!(message.contains("this validator always traps (settings {})"), "{message}")
        }
        other => panic!("expected a trap, got {other:?}"),
    }
    // Every call gets a fresh instance: the next one traps the same way, it does not hang.
    assert!(matches!(module.validate_settings("{}"), Err(CallError::Trap(_))));
}

#[test]
fn a_refusal_over_the_output_cap_is_an_error() {
    let rt = runtime(Limits { max_output_bytes: 16, ..Limits::default() });
    let module = rt.load("port-filter", artifacts::examples::PORT_FILTER_TRANSLATOR, None, usize::MAX).unwrap();
    assert!(matches!(module.validate_settings(r#"{"lable": "team"}"#), Err(CallError::OutputTooLarge(_))));
    assert_eq!(module.validate_settings("{}"), Ok(SettingsVerdict::Valid));
}

#[test]
fn a_validator_of_another_signature_is_refused_at_load() {
    let rt = runtime(Limits::default());
    let err = rt.load("w", artifacts::test_programs::WRONG_VALIDATOR, None, usize::MAX).err().expect("refused");
    match &err {
        LoadError::SettingsValidation { export, reason } => {
            assert_eq!(export, "wasmplane:dataplane/settings-validation@1.0.0");
            assert!(reason.contains("`validate` is `func(string) -> (bool)`"), "{reason}");
            assert!(reason.contains("expected `validate: func(settings: string) -> result<_, string>`"), "{reason}");
        }
        other => panic!("expected a settings-validation load error, got {other:?}"),
    }
}
