//! gpumem's integration tests: one binary, sharing helpers.

mod agent;
mod assets;
mod browser;
mod common;
mod docs;
mod expandable;
mod explain;
mod fit_order;
#[cfg(feature = "cuda")]
mod gpu;
mod hostile;
mod ingest;
mod ipc;
mod kubelet;
mod layout;
mod lifecycle;
mod node_view;
mod oom_path;
mod plan;
mod plan_live;
mod pod_network;
mod private_pools;
mod properties;
mod push_jobs;
mod pytorch_keys;
mod recordings;
mod recordings_2_15;
mod replay;
mod replay_pools;
mod scenarios;
mod stress;
mod support;
mod tenant_alerts;
mod tenants;
mod view;
mod web_config;
