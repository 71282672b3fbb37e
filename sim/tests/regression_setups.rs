//! The regression seeds keep the runs that found their defects: none of them is drawn with the
//! tight buffers added after them (which would refuse some of its requests, and might no longer
//! reach what it guards). A seed found since in such a run may be added: it then says so here.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

#[test]
fn no_regression_seed_runs_with_tight_buffers() {
    let mut tight = Vec::new();
    for line in include_str!("../regressions.txt").lines() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let seed: u64 = line.split_whitespace().next().unwrap().parse().unwrap();
        let setup = sim::world::Setup::draw(&mut sim::choice::Choices::seeded(seed));
        if setup.filter_config.contains(r#""max_buffered_bytes""#) {
            tight.push(line.to_owned());
        }
    }
    assert!(
        tight.is_empty(),
        "regression seeds with tight buffers: {tight:#?}"
    );
}
