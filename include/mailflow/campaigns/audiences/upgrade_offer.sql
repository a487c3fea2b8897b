-- upgrade_offer (priority 3): finished at least one free test in the window, on the free plan.
--
-- Rule: at least one assessment with is_free and window_start <= finished_at < window_end,
-- and users.plan = 'free'.
-- Caveat: plan is the user's CURRENT plan (app.users has no plan history), not the plan
-- as of window_end.  For the live hourly run that is what we want (never offer pro to a
-- payer); a re-run of an old window skips people who have upgraded since and is not an
-- exact replay.
--
-- Parameters: window_start, window_end (timestamptz, half-open window [start, end)).
-- The engine adds cooldown / suppression / dedupe exclusions and keyset pagination.
--
-- Columns:
--   user_id              bigint  unique per row
--   email                text
--   first_name           text    may be null or empty
--   free_tests_finished  int     free tests finished in the window (>= 1) (template: copy)
--   best_score           int     best score among them, 0..100, null if none was scored
--
-- Requires: an index on app.assessments (finished_at) INCLUDE (user_id, score) WHERE is_free (the
-- demo schema's assessments_finished_at_free_cover_idx): the window is then one index-only range
-- instead of a heap visit per assessment (docs/performance.md, "Audience snapshot").
select u.user_id,
       u.email,
       u.first_name,
       f.free_tests_finished,
       f.best_score
from app.users u
join (
        select a.user_id,
               count(*)::int as free_tests_finished,
               max(a.score) as best_score
        from app.assessments a
        where a.is_free
          and a.finished_at >= %(window_start)s
          and a.finished_at < %(window_end)s
        group by a.user_id
     ) f on f.user_id = u.user_id
where u.plan = 'free'
