"""Cost of validating one finished JSON output (grammar/validation.py), per schema size.

    .venv/bin/python bench/schema_validation.py

prints the markdown rows of BENCHMARKS.md's "Output validation cost" table.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path[:1]:
    sys.path.insert(0, str(ROOT))

from grammar.validation import SchemaValidator  # noqa: E402
from tests.e2e.test_structured import ORDER, PERSON  # noqa: E402


def big(n: int) -> tuple[dict, dict]:
    props = {f"field_{i}": {"type": ["string", "integer"][i % 2],
                            **({"maxLength": 20} if i % 2 == 0 else {"minimum": 0})} for i in range(n)}
    schema = {"type": "object", "properties": props, "required": list(props),
              "additionalProperties": False}
    return schema, {k: ("abc" if v["type"] == "string" else 5) for k, v in props.items()}


def main() -> None:
    cases = [
        ("person (4 props)", PERSON, {"name": "Ann", "age": 30, "role": "admin", "active": True}),
        ("order (nested, 5 props)", ORDER, {
            "order_id": "ord-1234", "status": "paid",
            "customer": {"first_name": "Bo", "country_code": "DE"},
            "items": [{"sku": "a1", "quantity": 2}], "gift_wrap": False}),
        ("50 props", *big(50)),
        ("500 props", *big(500)),
        ("array of 10k ints, uniqueItems",
         {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, list(range(10000))),
    ]
    print("| schema | output bytes | build ms | validate p50 µs | validate p99 µs |")
    print("|---|---|---|---|---|")
    for name, schema, instance in cases:
        text = json.dumps(instance, separators=(",", ":"))
        start = time.perf_counter()
        validator = SchemaValidator(schema)
        build = time.perf_counter() - start
        assert validator.validate_text(text).valid
        times = []
        for _ in range(2000 if len(text) < 20000 else 200):
            start = time.perf_counter()
            validator.validate_text(text)
            times.append(time.perf_counter() - start)
        times.sort()
        print(f"| {name} | {len(text)} | {build * 1e3:.2f} | {statistics.median(times) * 1e6:.1f} "
              f"| {times[int(0.99 * len(times))] * 1e6:.1f} |")


if __name__ == "__main__":
    main()
