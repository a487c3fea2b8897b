-- first_practice (priority 2): signed up in the window and has not started any assessment.
--
-- Rule: window_start <= signed_up_at < window_end, and no assessment with
-- started_at < window_end (assessments started after the window do not count, so a
-- re-run of an old window selects the same people).
--
-- Parameters: window_start, window_end (timestamptz, half-open window [start, end)).
-- The engine adds cooldown / suppression / dedupe exclusions and keyset pagination.
--
-- Columns:
--   user_id     bigint  unique per row
--   email       text
--   first_name  text    may be null or empty
select u.user_id,
       u.email,
       u.first_name
from app.users u
where u.signed_up_at >= %(window_start)s
  and u.signed_up_at < %(window_end)s
  and not exists (
        select 1
        from app.assessments a
        where a.user_id = u.user_id
          and a.started_at < %(window_end)s
      )
