"""``python -m tests.verl.echo_args ARGS...`` prints its arguments as JSON: the launch line a
verl script builds, after bash expanded it, without starting a trainer."""

import json
import sys

print(json.dumps(sys.argv[1:]))
