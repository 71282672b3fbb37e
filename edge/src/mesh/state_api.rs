//! The state API in the cluster: its `Namespace`, `Secret`, `Deployment`, `Service`,
//! `PodDisruptionBudget` and `NetworkPolicy`, and the secrets they hold.

use std::collections::BTreeMap;

use contract::state_env;
use yaml_rust2::Yaml;

use super::*;
use crate::yaml::n;

/// The state API's secrets, from the file or as placeholders that say where to set them.
pub struct Secrets {
    pub token: String,
    pub key_secret: String,
    pub database_url: String,
    pub storage_key: String,
}

pub fn secrets(cfg: &Config) -> Secrets {
    let st = &cfg.state;
    Secrets {
        token: st
            .token
            .clone()
            .unwrap_or_else(|| "SET-state.token-IN-THE-FILE".into()),
        key_secret: st
            .key_secret
            .clone()
            .unwrap_or_else(|| "SET-state.key_secret-IN-THE-FILE".into()),
        database_url: st
            .database_url
            .clone()
            .unwrap_or_else(|| "postgres://USER:PASSWORD@HOST:5432/DATABASE".into()),
        storage_key: st.storage_key.clone().unwrap_or_else(|| {
            "SET-state.storage_key-IN-THE-FILE (openssl rand -base64 32)".into()
        }),
    }
}

/// The state API's environment variables that hold secrets: they go into its Secret.
const SECRET_VARIABLES: &[&str] = &[
    state_env::DATABASE_URL,
    state_env::STATE_API_TOKEN,
    state_env::IDEM_KEY_SECRET,
    state_env::IDEM_PREVIOUS_KEY_SECRET,
    state_env::STATE_API_STORAGE_KEY,
    state_env::STATE_API_PREVIOUS_STORAGE_KEY,
    state_env::STATE_API_ADMIN_TOKEN,
];
pub(super) fn state_api_objects(cfg: &Config, target: Target) -> Vec<Yaml> {
    let m = &cfg.mesh;
    let ns = &m.namespace;
    let port = cfg.state.listen.port();
    let sec = secrets(cfg);
    let mut env = render::state_api_env(cfg, &sec.database_url, &sec.token, &sec.key_secret);
    if cfg.state.storage_key.is_none() {
        env.push((
            state_env::STATE_API_STORAGE_KEY.into(),
            sec.storage_key.clone(),
        ));
    }
    let (secret_env, plain_env): (Vec<_>, Vec<_>) = env
        .into_iter()
        .filter(|(k, _)| k != state_env::LISTEN_ADDR)
        .partition(|(k, _)| SECRET_VARIABLES.contains(&k.as_str()));
    let selector = map(vec![("app.kubernetes.io/name", s(STATE_API))]);
    let pod = pod_template(cfg, target, &plain_env);
    let secret_data = map(secret_env
        .iter()
        .map(|(k, v)| (k.as_str(), s(v.clone())))
        .collect());
    vec![
        map(vec![
            ("apiVersion", s("v1")),
            ("kind", s("Namespace")),
            (
                "metadata",
                map(vec![("name", s(ns.clone())), ("labels", labels())]),
            ),
        ]),
        object(
            "v1",
            "Secret",
            STATE_API,
            ns,
            vec![("type", s("Opaque")), ("stringData", secret_data)],
        ),
        object(
            "apps/v1",
            "Deployment",
            STATE_API,
            ns,
            vec![(
                "spec",
                map(vec![
                    ("replicas", n(u64::from(m.replicas))),
                    ("selector", map(vec![("matchLabels", selector.clone())])),
                    (
                        "strategy",
                        map(vec![
                            ("type", s("RollingUpdate")),
                            (
                                "rollingUpdate",
                                map(vec![("maxUnavailable", n(0)), ("maxSurge", n(1))]),
                            ),
                        ]),
                    ),
                    ("template", pod),
                ]),
            )],
        ),
        object(
            "v1",
            "Service",
            STATE_API,
            ns,
            vec![(
                "spec",
                map(vec![
                    ("selector", selector.clone()),
                    (
                        "ports",
                        Yaml::Array(vec![map(vec![
                            ("name", s("http")),
                            ("port", n(u64::from(port))),
                            ("targetPort", s("http")),
                        ])]),
                    ),
                ]),
            )],
        ),
        object(
            "policy/v1",
            "PodDisruptionBudget",
            STATE_API,
            ns,
            vec![(
                "spec",
                map(vec![
                    ("minAvailable", n(1)),
                    ("selector", map(vec![("matchLabels", selector.clone())])),
                ]),
            )],
        ),
        network_policy(cfg, target, selector),
    ]
}

/// The pod: non-root, read-only, the migrations in an init container, the plain settings in
/// its environment and the secret ones from the Secret, probed on `/readyz` and `/healthz`.
fn pod_template(cfg: &Config, target: Target, plain_env: &[(String, String)]) -> Yaml {
    let m = &cfg.mesh;
    let port = cfg.state.listen.port();
    let mut container_env = vec![map(vec![
        ("name", s(state_env::LISTEN_ADDR)),
        ("value", s(format!("0.0.0.0:{port}"))),
    ])];
    container_env.extend(
        plain_env
            .iter()
            .map(|(k, v)| map(vec![("name", s(k.clone())), ("value", s(v.clone()))])),
    );
    let non_root = map(vec![
        ("allowPrivilegeEscalation", Yaml::Boolean(false)),
        ("readOnlyRootFilesystem", Yaml::Boolean(true)),
        (
            "capabilities",
            map(vec![("drop", Yaml::Array(vec![s("ALL")]))]),
        ),
    ]);
    let from_secret = Yaml::Array(vec![map(vec![(
        "secretRef",
        map(vec![("name", s(STATE_API))]),
    )])]);
    let probe = |path: &str, period_s: u64| {
        map(vec![
            ("httpGet", map(vec![("path", s(path)), ("port", s("http"))])),
            ("periodSeconds", n(period_s)),
        ])
    };
    let mut pod_labels = vec![("app.kubernetes.io/name", s(STATE_API))];
    if target == Target::Istio {
        // No sidecar: the gateways reach it directly (DestinationRule `tls: DISABLE`), and its
        // migrations run before any sidecar could start.
        pod_labels.push(("sidecar.istio.io/inject", s("false")));
    }
    let image = s(m.state_api_image.clone());
    map(vec![
        ("metadata", map(vec![("labels", map(pod_labels))])),
        (
            "spec",
            map(vec![
                (
                    "securityContext",
                    map(vec![
                        ("runAsNonRoot", Yaml::Boolean(true)),
                        ("runAsUser", n(10_001)),
                        ("runAsGroup", n(10_001)),
                        ("seccompProfile", map(vec![("type", s("RuntimeDefault"))])),
                    ]),
                ),
                (
                    // The migrations run to the end before the server of a new version
                    // starts (sqlx holds an advisory lock: replicas starting together wait in
                    // turn); with maxUnavailable 0 the old pods serve meanwhile.
                    "initContainers",
                    Yaml::Array(vec![map(vec![
                        ("name", s("migrate")),
                        ("image", image.clone()),
                        ("args", Yaml::Array(vec![s("--migrate-only")])),
                        ("envFrom", from_secret.clone()),
                        ("securityContext", non_root.clone()),
                    ])]),
                ),
                (
                    "containers",
                    Yaml::Array(vec![map(vec![
                        ("name", s(STATE_API)),
                        ("image", image),
                        (
                            "ports",
                            Yaml::Array(vec![map(vec![
                                ("name", s("http")),
                                ("containerPort", n(u64::from(port))),
                            ])]),
                        ),
                        ("env", Yaml::Array(container_env)),
                        ("envFrom", from_secret),
                        ("readinessProbe", probe("/readyz", 5)),
                        ("livenessProbe", probe("/healthz", 10)),
                        (
                            "resources",
                            map(vec![(
                                "requests",
                                map(vec![("cpu", s("250m")), ("memory", s("128Mi"))]),
                            )]),
                        ),
                        ("securityContext", non_root),
                    ])]),
                ),
            ]),
        ),
    ])
}

/// Only the mesh's Envoys reach the state API.
fn network_policy(cfg: &Config, target: Target, selector: Yaml) -> Yaml {
    let m = &cfg.mesh;
    let ns = &m.namespace;
    let port = cfg.state.listen.port();
    let (envoy_ns, envoy_labels) = match target {
        Target::Istio => (m.istio_namespace.clone(), m.istio_labels.clone()),
        Target::EnvoyGateway => (
            m.gateway_proxy_namespace.clone(),
            BTreeMap::from([
                (
                    "gateway.envoyproxy.io/owning-gateway-name".into(),
                    m.gateway.clone(),
                ),
                (
                    "gateway.envoyproxy.io/owning-gateway-namespace".into(),
                    m.gateway_namespace.clone(),
                ),
            ]),
        ),
    };
    object(
        "networking.k8s.io/v1",
        "NetworkPolicy",
        STATE_API,
        ns,
        vec![(
            "spec",
            map(vec![
                ("podSelector", map(vec![("matchLabels", selector)])),
                ("policyTypes", Yaml::Array(vec![s("Ingress")])),
                (
                    "ingress",
                    Yaml::Array(vec![map(vec![
                        (
                            "from",
                            Yaml::Array(vec![map(vec![
                                (
                                    "namespaceSelector",
                                    map(vec![(
                                        "matchLabels",
                                        map(vec![("kubernetes.io/metadata.name", s(envoy_ns))]),
                                    )]),
                                ),
                                (
                                    "podSelector",
                                    map(vec![("matchLabels", string_map(&envoy_labels))]),
                                ),
                            ])]),
                        ),
                        (
                            "ports",
                            Yaml::Array(vec![map(vec![
                                ("protocol", s("TCP")),
                                ("port", n(u64::from(port))),
                            ])]),
                        ),
                    ])]),
                ),
            ]),
        )],
    )
}
