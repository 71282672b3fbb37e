"""One call of Stripe's own Python SDK against the edge, for tests/tests/sdks.rs.

Stock settings (the module-level API, `stripe.max_network_retries` = 2, its backoff and its
retry rules) but three: the API base is the edge, the API key is a demo JWT (sent as
`Authorization: Bearer`, which the edge authenticates) and the HTTP client's timeout is the
test's. The HTTP client is the SDK's own `RequestsClient`, counted: each attempt's status (or
the connection error) is recorded, nothing else is changed.

Reads one JSON object from argv[1]:
  {"base": "http://127.0.0.1:10000", "token": "<jwt>", "timeout_s": 1.5,
   "calls": [{"resource": "charge"|"refund", "params": {...}, "idempotency_key": "k" (optional)}]}
Runs the calls concurrently (one thread each) and prints one JSON line: for each call, what the
SDK finally gave (the object, or the exception's class, message, status and code) and the
attempts it made.
"""

import json
import sys
import threading

import stripe


class CountingClient(stripe.RequestsClient):
    """The SDK's requests-based client, recording each attempt per thread."""

    local = threading.local()

    def request(self, method, url, headers, post_data=None):
        attempts = CountingClient.local.attempts
        try:
            response = super().request(method, url, headers, post_data)
        except stripe.APIConnectionError as e:
            attempts.append({"error": type(e).__name__, "should_retry": e.should_retry})
            raise
        attempts.append(
            {
                "status": response[1],
                "idempotency_key": headers.get("Idempotency-Key"),
                "stripe_should_retry": response[2].get("stripe-should-retry"),
            }
        )
        return response


def call(spec, out):
    CountingClient.local.attempts = []
    resource = {"charge": stripe.Charge, "refund": stripe.Refund}[spec["resource"]]
    params = dict(spec["params"])
    if spec.get("idempotency_key"):
        params["idempotency_key"] = spec["idempotency_key"]
    result = {}
    try:
        obj = resource.create(**params)
        result["object"] = json.loads(str(obj))
    except stripe.StripeError as e:
        result["error"] = {
            "class": type(e).__name__,
            "message": e.user_message,
            "http_status": e.http_status,
            "code": e.code,
            "error_code": (e.error.code if e.error else None),
        }
    result["attempts"] = CountingClient.local.attempts
    out.append(result)


def main():
    args = json.loads(sys.argv[1])
    stripe.api_key = args["token"]
    stripe.api_base = args["base"]
    stripe.default_http_client = CountingClient(timeout=args["timeout_s"])
    results = [[] for _ in args["calls"]]
    threads = [
        threading.Thread(target=call, args=(spec, results[i]))
        for i, spec in enumerate(args["calls"])
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    print(json.dumps({"sdk": "stripe-python " + stripe.VERSION, "results": [r[0] for r in results]}))


if __name__ == "__main__":
    main()
