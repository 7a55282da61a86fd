//! The module's own settings (the `settings` capability): one JSON document the operator
//! gives with the module, `{}` when none (Kubewarden's policy settings). Parse them with
//! the JSON crate of your choice and fail calls with a [`GuestError`](crate::types::GuestError)
//! naming a bad setting: the host then refuses the settings and keeps those in force. Export
//! the same check with [`export_settings_validator!`](crate::export_settings_validator) and
//! the host refuses bad settings before it stores them, with nothing to translate needed.
//!
//! On a native build (unit tests of guest logic) they are what [`set_for_tests`] gave the
//! current thread, `{}` otherwise.

/// The settings document.
pub fn raw() -> String {
    #[cfg(target_family = "wasm")]
    return crate::service::wasmplane::dataplane::settings::get();
    #[cfg(not(target_family = "wasm"))]
    NATIVE.with(|s| s.borrow().clone())
}

#[cfg(not(target_family = "wasm"))]
thread_local! {
    static NATIVE: std::cell::RefCell<String> = std::cell::RefCell::new("{}".to_string());
}

/// What [`raw`] answers on this thread of a native test.
#[cfg(not(target_family = "wasm"))]
pub fn set_for_tests(settings: &str) {
    NATIVE.with(|s| *s.borrow_mut() = settings.to_string());
}
