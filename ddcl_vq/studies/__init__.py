"""Many runs at once: ``ddcl-vq study`` (:mod:`.study`, :mod:`.parts`, :mod:`.report`), ``compare`` (:mod:`.tables`,
:mod:`.plots`, :mod:`.freshness`), the prior's study (:mod:`.prior_study`), ``bench/`` and ``readout/``."""
