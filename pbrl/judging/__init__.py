"""Pairwise judges of joint responses (docs/design/algorithms.md#judges): the interface every judge implements
(:mod:`pbrl.judging.verdicts`), the prompt a language-model judge reads (:mod:`pbrl.judging.prompt`), the store that
keeps every answer so that no comparison is asked twice (:mod:`pbrl.judging.store`), and the judges: a Python
callable (:mod:`pbrl.judging.callable_judge`), the task reward with label noise (:mod:`pbrl.judging.simulated`), an
API model (:mod:`pbrl.judging.api_judge`) and a local causal LM (:mod:`pbrl.judging.local_judge`), the last two built
from plain option values by :mod:`pbrl.judging.factory`."""
