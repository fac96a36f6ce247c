"""The book's tooling, above the science (which never imports it): the ``qkov`` command line
(:mod:`.cli`), a chapter run through papermill (:mod:`.chapters`), parameter sweeps of chapters
(:mod:`.sweeps`), the library-keyed execution cache and Sphinx hooks (:mod:`.cache`,
:mod:`.bookhtml`), results files (:mod:`.results`), the claims scorecard (:mod:`.scorecard`) and how tables are
shown (:mod:`.tables`: importing this package sets pandas' display options, so no table is cut)."""

from qkov_lib.tooling.tables import setup_display_when_imported as _setup_display

_setup_display()  # every chapter's first cell imports this package: its tables are shown whole
