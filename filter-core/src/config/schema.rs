//! The plugin configuration's JSON Schema (`edge schema`), generated from its types.

use super::Config;

/// The JSON Schema of the plugin configuration, generated from [`Config`]'s types, in JSON
/// Schema draft 4: the draft Kong reads (a filter's `config_schema`), which every validator
/// also reads. `null` is no value anywhere: the reader refuses it too.
#[cfg(feature = "schema")]
pub fn json_schema() -> serde_json::Value {
    let generator = schemars::generate::SchemaSettings::draft07()
        .with(|s| {
            s.meta_schema = Some("http://json-schema.org/draft-04/schema#".into());
        })
        .into_generator();
    let mut schema = generator.into_root_schema_for::<Config>().to_value();
    as_draft4(&mut schema);
    schema
}

/// Draft 4 has no `const`: a one-value `enum` says the same. And an optional field is left
/// out, never `null` (schemars lets an `Option` be `null`).
#[cfg(feature = "schema")]
fn as_draft4(v: &mut serde_json::Value) {
    use serde_json::Value as J;
    let is_null_type = |t: &J| t.get("type").and_then(J::as_str) == Some("null");
    match v {
        J::Object(map) => {
            if let Some(c) = map.remove("const") {
                map.insert("enum".into(), J::Array(vec![c]));
            }
            if let Some(J::Array(types)) = map.get_mut("type") {
                types.retain(|t| t != "null");
                if let [only] = types.as_slice() {
                    let only = only.clone();
                    map.insert("type".into(), only);
                }
            }
            if let Some(J::Array(branches)) = map.get_mut("anyOf") {
                branches.retain(|b| !is_null_type(b));
                if branches.len() == 1 {
                    if let Some(branches) = map.remove("anyOf") {
                        map.insert("allOf".into(), branches);
                    }
                }
            }
            map.values_mut().for_each(as_draft4);
        }
        serde_json::Value::Array(items) => items.iter_mut().for_each(as_draft4),
        _ => {}
    }
}
