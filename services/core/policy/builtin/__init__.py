"""Built-in policies, one small module each (and the large-fleet paths of two of them,
``kv_fast`` and ``slo_fast``). Importing this package registers them all.

To add a policy: write a module here with a :class:`~services.core.policy.base.PolicyImpl`
subclass decorated with ``@register`` and import it below.
"""

from services.core.policy.builtin import (  # noqa: F401
    dynamo_kv,
    gpu_aware,
    kv_aware,
    kv_load,
    least_request,
    llmd,
    pd_dynamo,
    pd_llmd,
    pd_round_robin,
    pd_sglang,
    pd_slo,
    power_of_two,
    prefix,
    random_pick,
    round_robin,
    sglang_cache_aware,
    slo_aware,
    weighted,
)
