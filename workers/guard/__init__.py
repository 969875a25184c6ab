"""The canary guard (`tolk guard`): replies counted per window, language and arm, judged against
the language's SLO and the stable arm, and the canary's shares moved through the control topic.

`windows` (pure: observations, counts, percentiles) and `policy` (pure: verdicts, rollout
states, decisions) hold the logic; `app` is the faust app around them, `events` the rollout
events topic and the shares, `metrics` the Prometheus container. docs/ARCHITECTURE.md,
"Canary rollouts", follows the control loop.
"""
