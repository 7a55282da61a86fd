//! The tree is formatted as `rustfmt.toml` says (rust-analyzer's `tidy` check): a change that
//! skipped `cargo fmt --all` fails here, naming the files, instead of leaving the reformatting
//! and its noise in the next person's diff.

use std::process::Command;

use wasmplane_test_deploy::workspace;

fn cargo() -> String {
    std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_string())
}

#[test]
fn the_workspace_is_formatted() {
    let out = Command::new(cargo())
        .args(["fmt", "--all", "--check", "--", "--files-with-diff"])
        .current_dir(workspace())
        .output()
        .expect("run cargo fmt (scripts/setup.sh installs rustfmt)");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!stderr.contains("is not installed"), "rustfmt is missing; scripts/setup.sh installs it: {stderr}");
    let files = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "not formatted (run `cargo fmt --all`):\n{files}{stderr}");
}

/// The check above sees a difference when there is one: the workspace's own settings applied
/// to a file written against them.
#[test]
fn the_check_catches_an_unformatted_file() {
    let dir = std::env::temp_dir().join(format!("wasmplane-tidy-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("unformatted.rs");
    std::fs::write(&file, "fn  main( ) { let x = 1 ;println!(\"{x}\") }\n").unwrap();
    let config = workspace().join("rustfmt.toml");
    let status = Command::new("rustfmt")
        .args(["--check", "--edition", "2024", "--config-path"])
        .arg(&config)
        .arg(&file)
        .output()
        .expect("run rustfmt (scripts/setup.sh installs it)");
    std::fs::remove_dir_all(&dir).ok();
    assert!(!status.status.success(), "rustfmt --check passed an unformatted file");
}
