//! Host-side bindings generated from `wit/wasmplane.wit`.

pub mod service {
    wasmtime::component::bindgen!({
        path: "../../wit",
        world: "service-translation",
        additional_derives: [PartialEq, Eq, Hash],
    });
}
