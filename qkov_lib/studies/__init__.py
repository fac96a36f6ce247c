"""The studies the chapters run, one module per thing studied: the synthetic task
(:mod:`.synthetic`) and its sweeps (:mod:`.synthetic_sweeps`), the theory's reduction and
asymptotics against simulation (:mod:`.reduction`, :mod:`.asymptotics`), the real-data protocol map (:mod:`.realmap`)
with the attention analyses of its tuned models (:mod:`.attention_analysis`), HateXplain's
rationales (:mod:`.rationales`) and agreement roles (:mod:`.agreement_roles`), and the knob in
multi-layer models (:mod:`.multilayer`, :mod:`.pythia`). Each returns numbers, tables, figures
and verdicts; the chapters hold the prose."""
