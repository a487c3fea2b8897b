-- practice_tips (priority 4): active in the window.  Sells nothing.
--
-- Rule: window_start <= last_active_at < window_end, or an assessment with
-- window_start <= started_at < window_end.  The engine runs this campaign last, so
-- users picked by a higher-priority campaign in the same run are already excluded.
-- Caveat: last_active_at is CURRENT (the latest activity ever), so for a re-run of an
-- old window a user who was active then and again later is only found through an
-- assessment started in the window.
--
-- Parameters: window_start, window_end (timestamptz, half-open window [start, end)).
-- The engine adds cooldown / suppression / dedupe exclusions and keyset pagination.
--
-- Columns:
--   user_id      bigint  unique per row
--   email        text
--   first_name   text    may be null or empty
--   recent_kind  text    kind of the latest assessment started in the window (ties: the
--                        highest assessment_id); null if the user only browsed (template: copy)
--
-- Shape (docs/performance.md, "Audience snapshot"): the latest assessment of each user who started
-- one in the window is read once, as a set (one range of assessments_started_at_cover_idx, sorted by
-- user: DISTINCT ON), and hash-joined to the users; a "latest assessment" probe per candidate (a
-- LIMIT 1 lateral) cost ~4 us each, ~0.6 s for the ~146k candidates at 1M users. A user is a
-- candidate if active in the window or found in that set: the same rows as the union of the two
-- index ranges this file used before. The second arm says `r.user_id = u.user_id` (the join
-- condition: true exactly when r matched) instead of `r.user_id is not null`: with it the planner
-- estimates the ~15 percent of the users the filter keeps (it takes IS NOT NULL above a left join as
-- true for every row) and applies the engine's exclusions to the candidates, not to every user.
-- Requires: an index on app.assessments (started_at) INCLUDE (user_id, assessment_id, kind) (the
-- demo schema's assessments_started_at_cover_idx); without it the window is a heap visit per
-- assessment (same rows, slower).
select u.user_id,
       u.email,
       u.first_name,
       r.kind as recent_kind
from app.users u
left join (
        select distinct on (a.user_id) a.user_id, a.kind
        from app.assessments a
        where a.started_at >= %(window_start)s
          and a.started_at < %(window_end)s
        order by a.user_id, a.started_at desc, a.assessment_id desc
     ) r on r.user_id = u.user_id
where (u.last_active_at >= %(window_start)s and u.last_active_at < %(window_end)s)
   or r.user_id = u.user_id
