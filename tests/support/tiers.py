"""The tests scripts/test runs in tiers of their own (see tests/conftest.py)."""

#: Slow checks that a statement, a pass or an encoder acts as another form of it does, and
#: checks at a large scale (by test function name). They do not depend on the Django version:
#: scripts/test runs them in its first leg only, as the ``once`` tests.
HEAVY = frozenset(
    {
        "test_a_huge_mixed_tenant_batch_gets_ids_in_exactly_the_given_order",
        "test_a_pass_is_counted_as_looking_up_every_token_would",
        "test_any_batch_reports_and_writes_the_same_on_every_path_as_promised",
        "test_any_handler_sequence_is_reported_and_leaves_the_thread_clean",
        "test_any_payload_copied_is_stored_as_the_insert_statement_stores_it",
        "test_any_weights_hold_over_time_for_any_claim_sizes",
        "test_dumps_writes_or_refuses_odd_values_as_the_standard_strict_encoder_does",
        "test_each_job_of_a_batch_is_the_job_it_would_be_alone",
        "test_ending_a_job_fifty_thousand_others_wait_for_is_one_insert",
        "test_inside_a_transaction_a_large_batch_stores_and_reports_what_the_general_path_did",
        "test_one_large_pass_costs_no_more_than_small_passes_of_the_same_jobs",
        "test_the_fair_pass_writes_and_claims_what_record_then_claim_would",
        "test_the_key_statements_act_as_the_key_rules_say_on_any_table_of_a_few_keys",
        "test_the_pass_writes_and_claims_what_record_then_claim_would",
        "test_the_release_settles_any_graph_and_outcomes_as_the_rules_say",
        "test_weights_hold_over_time_whatever_the_claim_size",
    }
)

#: Tests that time the machine: how soon a handler starts, how smooth a rate is, how much CPU
#: a stalled process got. Beside other tests busying the CPU they fail for want of it, so they
#: run alone (tests/support/alone.py), at the end of the run (by test function name).
ALONE = frozenset(
    {
        "test_a_rate_limit_is_shared_by_the_workers_and_smooth",
        "test_a_stopped_process_is_not_blamed_on_the_gil",
        "test_a_thread_that_holds_the_gil_is_named",
        "test_handlers_that_wait_a_few_milliseconds_on_io_each_get_a_thread_at_once",
        "test_tasks_waiting_behind_python_that_runs_get_threads_slowly",
        "test_the_scheduler_keeps_the_home_database_going_while_the_other_server_is_down",
    }
)
