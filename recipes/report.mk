# What the recipes keep and print, included by recipes/flow_grpo.mk and recipes/eval.mk.
#
# Each stage runs with --json: its result object goes to RUN/it<K>/<stage>.json (eval/<stage>.json for
# the held-out evaluation, it<K>/update.json for the update that trains on iteration K), written once the
# stage succeeded, and its progress to stderr (a line at least every 30 s off a terminal: a make log, a
# Slurm log). Once iteration K is finished (the files each recipe names as its line's prerequisites),
# stdout gets one line, `omnirl report RUN --iteration K`: the training reward mean ± standard error,
# the held-out reward ± se when evaluated, every named reward's mean (a strict accuracy), the zero-std
# share and the update's losses. The line is kept in RUN/it<K>/summary.txt, so a re-run that changes
# nothing prints nothing.
ifndef REPORT_MK
REPORT_MK := 1

# A stage's --json result into file $(1) (its folder must exist), renamed into place once the stage
# succeeded.
result = --json > $(1).tmp && mv $(1).tmp $(1)

$(RUN)/it%/summary.txt:
	@$(OMNIRL) report $(RUN) --iteration $* > $@.tmp && mv $@.tmp $@ && cat $@
endif
