//! Helpers for tests that run the host against the real kernel with real traffic.
#![allow(dead_code)]

pub mod cluster;
pub mod echo;
pub mod netns;
pub mod rest;
pub mod sctp;
