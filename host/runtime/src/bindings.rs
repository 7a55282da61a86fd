//! Host-side bindings generated from `wit/wasmplane.wit`.

pub mod service {
    wasmtime::component::bindgen!({
        path: "../../wit",
        world: "service-translation",
        // serde: record/replay files hold guest inputs in exactly this shape (host/src/record.rs).
        additional_derives: [PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize],
    });
}
