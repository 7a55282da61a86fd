//! `deploy/cni/`: the example conflists for chaining wasmplane after another plugin
//! (`wasmplane run --cni-chained`) are what a node needs: the address-giving plugin first,
//! `wasmplane-cni` last pointing at the agent's socket, no `portmap` (wasmplane serves
//! hostPort itself), and a file name the runtime picks before the other plugin's own.
//! Each check is also run against a broken variant it must reject.

use serde_json::Value;
use wasmplane_test_deploy::deploy_dir;

/// The agent's `--cni-socket`, as deploy/agent.yaml passes it.
fn agent_socket() -> String {
    let agent = std::fs::read_to_string(deploy_dir().join("agent.yaml")).expect("deploy/agent.yaml");
    agent
        .lines()
        .find_map(|l| l.trim().strip_prefix("- --cni-socket="))
        .expect("the agent passes --cni-socket")
        .to_string()
}

/// What is wrong with the chained conflist `text` installed as `file_name`.
fn violations(file_name: &str, text: &str, agent_socket: &str) -> Vec<String> {
    let mut v = Vec::new();
    // The runtime takes the first configuration by name; primary plugins install `10-*`.
    if file_name >= "10-" {
        v.push(format!("{file_name} does not sort before the other plugin's 10-*.conflist"));
    }
    let conf: Value = match serde_json::from_str(text) {
        Ok(conf) => conf,
        Err(e) => return vec![format!("{file_name} is not JSON: {e}")],
    };
    if conf["cniVersion"].as_str().is_none() || conf["name"].as_str().is_none_or(str::is_empty) {
        v.push(format!("{file_name} lacks cniVersion or name"));
    }
    let plugins = conf["plugins"].as_array().map(Vec::as_slice).unwrap_or_default();
    let ours: Vec<usize> =
        plugins.iter().enumerate().filter(|(_, p)| p["type"] == "wasmplane-cni").map(|(i, _)| i).collect();
    match ours.as_slice() {
        [i] if *i + 1 == plugins.len() && *i > 0 => {
            let p = &plugins[*i];
            if p["daemonSocket"] != agent_socket {
                v.push(format!(
                    "{file_name}: daemonSocket {} is not the agent's --cni-socket {agent_socket}",
                    p["daemonSocket"]
                ));
            }
            if p.get("daemonTimeoutSeconds").is_some_and(|t| t.as_u64().is_none_or(|t| t == 0)) {
                v.push(format!("{file_name}: daemonTimeoutSeconds is not a positive integer"));
            }
        }
        _ => v.push(format!(
            "{file_name}: wasmplane-cni must be the last plugin, once, after the one that gives pods their addresses"
        )),
    }
    if plugins.iter().any(|p| p["type"] == "portmap") {
        v.push(format!("{file_name}: portmap beside wasmplane, which serves hostPort itself"));
    }
    v
}

fn examples() -> Vec<(String, String)> {
    let dir = deploy_dir().join("cni");
    let mut found: Vec<(String, String)> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|entry| entry.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "conflist"))
        .map(|p| (p.file_name().unwrap().to_string_lossy().into_owned(), std::fs::read_to_string(&p).unwrap()))
        .collect();
    found.sort();
    found
}

#[test]
fn chained_conflist_examples_are_valid() {
    let examples = examples();
    assert!(
        examples.iter().any(|(name, _)| name.contains("chained")),
        "no chained example in deploy/cni: {examples:?}"
    );
    let socket = agent_socket();
    for (name, text) in &examples {
        let v = violations(name, text, &socket);
        assert!(v.is_empty(), "deploy/cni/{name}:\n  {}", v.join("\n  "));
    }
}

#[test]
fn broken_chained_conflists_are_caught() {
    let (name, text) = examples().into_iter().find(|(name, _)| name.contains("chained")).expect("a chained example");
    let socket = agent_socket();
    let conf: Value = serde_json::from_str(&text).unwrap();
    let caught = |name: &str, conf: &Value, says: &str| {
        let v = violations(name, &conf.to_string(), &socket);
        assert!(v.iter().any(|v| v.contains(says)), "{says:?} not among {v:?}");
    };
    let mut first = conf.clone();
    first["plugins"].as_array_mut().unwrap().reverse();
    caught(&name, &first, "last plugin");
    let mut alone = conf.clone();
    alone["plugins"].as_array_mut().unwrap().remove(0);
    caught(&name, &alone, "last plugin");
    let mut portmap = conf.clone();
    portmap["plugins"]
        .as_array_mut()
        .unwrap()
        .insert(1, serde_json::json!({"type": "portmap", "capabilities": {"portMappings": true}}));
    caught(&name, &portmap, "portmap");
    let mut elsewhere = conf.clone();
    let last = elsewhere["plugins"].as_array().unwrap().len() - 1;
    elsewhere["plugins"][last]["daemonSocket"] = "/tmp/cni.sock".into();
    caught(&name, &elsewhere, "daemonSocket");
    caught("10-wasmplane-chained.conflist", &conf, "sort before");
}
