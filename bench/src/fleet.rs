//! The Envoys (and peers) `make bench` starts beside the stack: a plain Envoy, one with
//! jwt_authn only, the filter's Envoy with other settings (background completes, nothing
//! batched, the state API over mutual TLS), and the seeds' own design.

use std::path::PathBuf;

use test_support::envoy::{plain_template_path, Envoy};
use test_support::services::Service;
use test_support::stack::Stack;

use crate::cpu::Procs;
use crate::{peer, plain_params, procfs};

/// The Envoys and peers the scenarios go through besides the stack's own Envoy.
pub(crate) struct Fleet {
    pub(crate) plain: Envoy,
    /// BENCH_ENVOY_TEMPLATE: the filter's scenarios through an Envoy rendered from another
    /// template (same parameters), e.g. envoy.yaml.tmpl with a change to try.
    pub(crate) alt: Option<Envoy>,
    pub(crate) jwt: Envoy,
    /// The same filter Envoy with `complete_in_background` (scenario new_bg).
    pub(crate) background: Option<Envoy>,
    /// The same filter Envoy with every claim its own callout (`batch_max = 1`, new_single).
    pub(crate) single: Option<Envoy>,
    /// A second state API serving HTTPS with client certificates, and its Envoy (new_tls).
    pub(crate) tls_hop: Option<(Service, Envoy)>,
    /// The seeds' own design, on the same Postgres (seed_new, seed_inflight).
    pub(crate) seed: Option<peer::SeedNode>,
    /// The seeds' design behind the same Envoy and jwt_authn as ours (seed_edge).
    pub(crate) seed_edge: Option<Envoy>,
}

impl Fleet {
    pub(crate) fn start(stack: &Stack, wanted: impl Fn(&str) -> bool) -> Result<Self, String> {
        let plain = Envoy::start_with_template(
            &plain_template_path(),
            plain_params(stack),
            &stack.dir,
            "envoy-plain",
        )?;
        let alt = match std::env::var("BENCH_ENVOY_TEMPLATE") {
            Ok(t) => Some(Envoy::start_with_template(
                std::path::Path::new(&t),
                plain_params(stack),
                &stack.dir,
                "envoy-alt",
            )?),
            Err(_) => None,
        };
        let jwt_template = jwt_template();
        let jwt = Envoy::start_with_template(
            &jwt_template,
            plain_params(stack),
            &stack.dir,
            "envoy-jwt",
        )?;
        let background = if wanted("new_bg") {
            let mut p = plain_params(stack);
            p.complete_in_background = true;
            Some(Envoy::start(p, &stack.dir, "envoy-bg")?)
        } else {
            None
        };
        let single = if wanted("new_single") {
            let mut p = plain_params(stack);
            p.tweak = Some(test_support::envoy::Tweak::new(|cfg| {
                cfg.filter.batch_max = 1
            }));
            Some(Envoy::start(p, &stack.dir, "envoy-single")?)
        } else {
            None
        };
        let tls_hop = if wanted("new_tls") {
            Some(start_tls_hop(stack)?)
        } else {
            None
        };
        let seed = if wanted("seed_new") || wanted("seed_inflight") || wanted("seed_edge") {
            Some(peer::SeedNode::start(stack, &stack.dir)?)
        } else {
            None
        };
        let seed_edge = match &seed {
            Some(s) if wanted("seed_edge") => {
                let mut p = plain_params(stack);
                p.checkout_port = s.port;
                Some(Envoy::start_with_template(
                    &jwt_template,
                    p,
                    &stack.dir,
                    "envoy-seed",
                )?)
            }
            _ => None,
        };
        Ok(Self {
            plain,
            alt,
            jwt,
            background,
            single,
            tls_hop,
            seed,
            seed_edge,
        })
    }

    /// The Envoy with the filter the scenarios measure.
    pub(crate) fn filter_envoy<'a>(&'a self, stack: &'a Stack) -> &'a Envoy {
        self.alt.as_ref().unwrap_or(&stack.envoy)
    }

    /// Every Envoy by the name the report gives it.
    pub(crate) fn envoys<'a>(&'a self, stack: &'a Stack) -> Vec<(&'static str, &'a Envoy)> {
        let mut envoys = vec![
            ("envoy", self.filter_envoy(stack)),
            ("envoy-plain", &self.plain),
            ("envoy-jwt", &self.jwt),
        ];
        if let Some(bg) = &self.background {
            envoys.push(("envoy-bg", bg));
        }
        if let Some(one) = &self.single {
            envoys.push(("envoy-single", one));
        }
        if let Some((_, envoy)) = &self.tls_hop {
            envoys.push(("envoy-tls", envoy));
        }
        if let Some(e) = &self.seed_edge {
            envoys.push(("envoy-seed", e));
        }
        envoys
    }

    /// The processes whose CPU and memory the report shows, found by the ports they listen on.
    pub(crate) fn procs(&self, stack: &Stack) -> Result<Procs, String> {
        let find = |port: u16, what: &str| {
            procfs::pid_listening_on(port)
                .ok_or_else(|| format!("no process listens on :{port} ({what})"))
        };
        let filter_envoy = self.filter_envoy(stack);
        let mut procs = Procs {
            named: vec![
                ("envoy", find(filter_envoy.params.listen_port, "envoy")?),
                (
                    "envoy-plain",
                    find(self.plain.params.listen_port, "envoy-plain")?,
                ),
                ("envoy-jwt", find(self.jwt.params.listen_port, "envoy-jwt")?),
                ("state-api", find(stack.state_api.port, "state-api")?),
                ("checkout", find(stack.checkout.port, "checkout")?),
            ],
            postgres: procfs::pid_listening_on(stack.postgres.port()),
        };
        if let Some(bg) = &self.background {
            procs
                .named
                .push(("envoy-bg", find(bg.params.listen_port, "envoy-bg")?));
        }
        if let Some(one) = &self.single {
            procs.named.push((
                "envoy-single",
                find(one.params.listen_port, "envoy-single")?,
            ));
        }
        if let Some((api, envoy)) = &self.tls_hop {
            procs
                .named
                .push(("envoy-tls", find(envoy.params.listen_port, "envoy-tls")?));
            procs
                .named
                .push(("state-api-tls", find(api.port, "state-api-tls")?));
        }
        if let Some(s) = &self.seed {
            procs.named.push(("seed-node", s.pid));
        }
        if let Some(e) = &self.seed_edge {
            procs
                .named
                .push(("envoy-seed", find(e.params.listen_port, "envoy-seed")?));
        }
        Ok(procs)
    }
}

/// BENCH_JWT_TEMPLATE: another jwt-only config to compare (e.g. with jwt_cache_config).
fn jwt_template() -> PathBuf {
    std::env::var("BENCH_JWT_TEMPLATE")
        .map(PathBuf::from)
        .unwrap_or_else(|_| {
            test_support::process::workspace_root().join("bench/envoy-jwt.yaml.tmpl")
        })
}

/// The state API hop over mutual TLS: a second state API on the same database serving HTTPS
/// with client certificates required, and a filter Envoy that verifies it and presents its own
/// (certificates made now, rcgen), next to the plain pair.
fn start_tls_hop(stack: &Stack) -> Result<(Service, Envoy), String> {
    let pki = test_support::tls::TestPki::generate(&stack.dir.join("pki"))?;
    let api = stack.start_extra_state_api_tls(&pki, &pki.server)?;
    let mut p = plain_params(stack);
    p.state_api_port = api.port;
    let tls = pki.state_tls(&pki.server);
    p.tweak = Some(test_support::envoy::Tweak::new(move |cfg| {
        cfg.state.tls = Some(tls.clone())
    }));
    let envoy = Envoy::start(p, &stack.dir, "envoy-tls")?;
    Ok((api, envoy))
}
