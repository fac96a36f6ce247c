"""The book's tooling, above the science (which never imports it): the ``qkov`` command line
(:mod:`.cli`), a chapter run through papermill (:mod:`.chapters`), parameter sweeps of chapters
(:mod:`.sweeps`), the library-keyed execution cache and Sphinx hooks (:mod:`.cache`,
:mod:`.bookhtml`), results files (:mod:`.results`) and the claims scorecard (:mod:`.scorecard`)."""
