// One call of Stripe's own Node SDK against the edge, for tests/tests/sdks.rs: the same input
// and report as stripe_call.py (read it first).
//
// Stock settings (maxNetworkRetries 2, its backoff and retry rules) but three: the host is the
// edge, the API key a demo JWT, the timeout the test's. Each call has a Stripe instance of its
// own whose HTTP client is the SDK's own Node client, counted: each attempt's status (or the
// connection error) is recorded, nothing else is changed.

import Stripe from 'stripe';

const args = JSON.parse(process.argv[2]);
const base = new URL(args.base);

async function call(spec) {
  const attempts = [];
  const inner = Stripe.createNodeHttpClient();
  const counting = Object.create(inner);
  counting.makeRequest = async (host, port, path, method, headers, data, protocol, timeout) => {
    try {
      const res = await inner.makeRequest(host, port, path, method, headers, data, protocol, timeout);
      attempts.push({
        status: res.getStatusCode(),
        idempotency_key: headers['Idempotency-Key'] ?? null,
        stripe_should_retry: res.getHeaders()['stripe-should-retry'] ?? null,
      });
      return res;
    } catch (e) {
      attempts.push({ error: e.code ?? e.name, idempotency_key: headers['Idempotency-Key'] ?? null });
      throw e;
    }
  };
  const stripe = new Stripe(args.token, {
    host: base.hostname,
    port: Number(base.port),
    protocol: base.protocol.replace(':', ''),
    timeout: Math.round(args.timeout_s * 1000),
    httpClient: counting,
  });
  const resource = { charge: stripe.charges, refund: stripe.refunds }[spec.resource];
  const options = spec.idempotency_key ? { idempotencyKey: spec.idempotency_key } : {};
  const result = {};
  try {
    result.object = await resource.create(spec.params, options);
    // The SDK adds a non-enumerable lastResponse; the JSON is the object's own members.
    result.object = JSON.parse(JSON.stringify(result.object));
  } catch (e) {
    result.error = {
      class: e.type ?? e.name,
      message: e.message,
      http_status: e.statusCode ?? null,
      code: e.code ?? null,
      error_code: e.raw?.code ?? null,
    };
  }
  result.attempts = attempts;
  return result;
}

const results = await Promise.all(args.calls.map(call));
console.log(JSON.stringify({ sdk: `stripe-node ${Stripe.PACKAGE_VERSION ?? ''}`.trim(), results }));
